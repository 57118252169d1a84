"""Writes tests/fakes/sglang_server_args.json: the `ServerArgs` fields of each pinned sglang wheel.

`sglang.Engine(**kwargs)` builds `ServerArgs(**kwargs)` (srt/entrypoints/engine.py), a msgspec
Struct that `msgspec.defstruct` assembles from the annotated fields of the namespace classes
listed in `_INPUT_NAMESPACES` (srt/server_args.py; collect_input_fields in
srt/arg_groups/fields/__init__.py): an unknown keyword is a TypeError. This script reads those
names from the wheels' source with `ast` (importing sglang needs its CUDA stack), so the fake
accepts exactly what the real Engine accepts.

    pip download --no-deps sglang==0.5.21 sglang==0.5.23 -d /tmp/wheels   # one version per call
    python tests/fakes/gen_server_args.py /tmp/wheels/sglang-0.5.21-*.whl /tmp/wheels/sglang-0.5.23-*.whl
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zipfile
from pathlib import Path

OUT = Path(__file__).with_name("sglang_server_args.json")


def server_args_fields(wheel: str) -> tuple[str, list[str]]:
    """(version, sorted ServerArgs field names) of one sglang wheel."""
    version = re.match(r"sglang-([^-]+)-", Path(wheel).name).group(1)
    with zipfile.ZipFile(wheel) as z:
        source = {n: z.read(n).decode() for n in z.namelist()
                  if n == "sglang/srt/server_args.py" or n.startswith("sglang/srt/arg_groups/fields/")}
    namespaces = None
    for node in ast.parse(source["sglang/srt/server_args.py"]).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_INPUT_NAMESPACES" for t in node.targets):
            namespaces = [elt.id for elt in node.value.elts]
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            own = [s for s in node.body if isinstance(s, ast.AnnAssign)]
            assert not own, "ServerArgs declares fields of its own: read them too"
    assert namespaces, "no _INPUT_NAMESPACES in server_args.py"
    classes = {}
    for name, text in source.items():
        if name.startswith("sglang/srt/arg_groups/fields/"):
            for node in ast.parse(text).body:
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = node
    fields: set[str] = set()
    for ns in namespaces:
        cls = classes[ns]
        assert [ast.unparse(b) for b in cls.bases] == ["msgspec.Struct"], (ns, "inherits fields: read them too")
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and "ClassVar" not in ast.unparse(stmt.annotation):
                name = stmt.target.id
                assert name not in fields, f"{name} declared twice"  # collect_input_fields refuses it too
                fields.add(name)
    return version, sorted(fields)


def main(wheels: list[str]) -> None:
    out = {"generated_by": "tests/fakes/gen_server_args.py", "versions": {}}
    for wheel in wheels:
        version, fields = server_args_fields(wheel)
        out["versions"][version] = {"wheel": Path(wheel).name, "num_fields": len(fields), "fields": fields}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{OUT}: " + ", ".join(f"{v} ({d['num_fields']} fields)" for v, d in out["versions"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write sglang_server_args.json from sglang wheels.")
    parser.add_argument("wheels", nargs="+", metavar="WHEEL", help="an sglang-VERSION-*.whl (one per version)")
    main(parser.parse_args().wheels)

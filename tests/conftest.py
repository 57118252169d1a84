import os
import re
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from runtime.supervisor import Supervisor


def _descendants() -> list[psutil.Process]:
    """Our descendants, less multiprocessing's resource tracker (it lives as long as pytest)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True)
def no_orphans():
    """Every test must leave no process behind (roles, their children, zombies aside)."""
    before = {p.pid for p in _descendants()}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in _descendants() if p.pid not in before and _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"orphan processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def gpu_run_metrics(request):
    """On the device, where `.ci/gpu` sets TANDEM_TEST_ARTIFACTS (a tar file under $OUT, one per
    shard): the metrics.jsonl of every run a GPU test made is appended to it as TEST__PATH,
    passed or failed, as the test ends, to set beside the CPU's curves. One archive, not a file
    each: the device tool brings back at most 8 files."""
    out = os.environ.get("TANDEM_TEST_ARTIFACTS")
    if not out or request.node.get_closest_marker("gpu") is None or "tmp_path" not in request.fixturenames:
        yield
        return
    tmp = request.getfixturevalue("tmp_path")
    yield
    paths = sorted(tmp.glob("**/metrics.jsonl"))
    if not paths:
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "a") as tar:
        for path in paths:
            # a parametrized test's [id] becomes _id_: names stay plain
            tar.add(path, arcname=re.sub(r"[^\w.-]", "_", request.node.name) + "__"
                    + "__".join(path.relative_to(tmp).parts))


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def sup(run_dir):
    """A supervisor with fast heartbeats, shut down after the test."""
    s = Supervisor(run_dir, heartbeat_interval=0.1, heartbeat_timeout=1.0, shutdown_grace_s=2.0)
    try:
        yield s
    finally:
        s.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random-init Qwen3 HF checkpoint directory (seed 0), shared by a test module."""
    from ppo.tiny_model import build_tiny_checkpoint
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def two_engines(ckpt, tmp_path_factory):
    """Two engine processes on the module's `ckpt`, shared by its tests (spawning them is most of
    the time). Heartbeats time out after 30 s: 1 s killed engines under this machine's load."""
    from roles.rollout import EngineConfig, RolloutEngine

    sup = Supervisor(tmp_path_factory.mktemp("run"), heartbeat_interval=0.5, heartbeat_timeout=30.0,
                     shutdown_grace_s=2.0)
    try:
        yield [sup.spawn(f"rollout-{i}", RolloutEngine,
                         EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=8, engine_index=i))
               for i in range(2)]
    finally:
        sup.shutdown()


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """(model dir, prompt file): the tiny_tools task and a tool model warm-started briefly (the
    recipe's full warm start takes ~40 s here)."""
    import json

    from ppo.generate.tiny_tools import build_tool_model
    from ppo.prompts.tasks import write_tool_sum_task

    root = tmp_path_factory.mktemp("tools")
    data = write_tool_sum_task(root / "sums.jsonl", num_prompts=64, seed=0)
    prompts = [json.loads(line)["prompt"] for line in open(data)]
    build_tool_model(str(root / "model"), prompts, seed=0, steps=120)
    return str(root / "model"), data


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    """The tiny model's tokenizer with Qwen's chat markup as whole tokens and a Qwen-like chat template."""
    from ppo.tiny_model import build_tiny_checkpoint, load_tokenizer
    from tests.test_generate_tools import QWEN_LIKE_TEMPLATE

    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen")), extra_tokens=(
        "<|im_start|>", "<|im_end|>", "\n", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        '"', "{", "}", ":", ","), chat_template=QWEN_LIKE_TEMPLATE)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are microseconds long; with 2 intra-op threads on a loaded 2-core
    machine, thread hand-offs made the trainer tests ~5x slower (measured 76 s vs 17 s)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip cleanly where there is no CUDA device (CI); `bash .ci/gpu` runs them."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `bash .ci/gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

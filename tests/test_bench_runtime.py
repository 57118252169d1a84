"""bench.runtime measures Tandem and the multiprocessing peer end to end in quick mode."""

import importlib.util
import io
import math

import pytest
from rich.console import Console

from bench.runtime import QUICK, main, metrics_of, render, run


@pytest.mark.slow  # 22 s, a benchmark's smoke run: `make test` is at its 20 minutes
@pytest.mark.timeout(120)
def test_quick_run_of_tandem_and_mp_reports_positive_numbers_and_ratios():
    results = run(["tandem", "mp"], quick=True)

    assert list(results["peers"]) == ["tandem", "mp"]
    keys = {m.key for m in metrics_of(QUICK)}
    assert keys == {"round_trip_p50_us", "round_trip_p99_us", "transfer_1MiB_gbps", "transfer_64MiB_gbps",
                    "transfer_256MiB_gbps", "shared_1MiB_gbps", "shared_64MiB_gbps", "shared_256MiB_gbps",
                    "spawn_8_s"}
    for name, peer in results["peers"].items():
        metrics = peer["metrics"]
        assert set(metrics) == keys, name
        assert all(math.isfinite(v) and v > 0 for v in metrics.values()), (name, metrics)
        assert metrics["round_trip_p50_us"] <= metrics["round_trip_p99_us"]
        assert len(peer["samples"]["spawn_s"]) == QUICK.num_spawns
        for kind in ("transfer_gbps", "shared_gbps"):
            assert all(len(rates) == QUICK.num_transfers for rates in peer["samples"][kind].values())
        assert peer["leftover_processes_killed"] == 0, name

    tandem, mp = results["peers"]["tandem"]["metrics"], results["peers"]["mp"]["metrics"]
    assert list(results["ratios"]) == ["tandem/mp"]
    for key, ratio in results["ratios"]["tandem/mp"].items():
        assert ratio == pytest.approx(tandem[key] / mp[key])
    # every target is against Ray, which was not measured
    assert [t["passed"] for t in results["targets"]] == [None] * 6
    assert set(results["memcpy_gbps"]) == {"1MiB", "64MiB", "256MiB"}
    assert all(v > 0 for v in results["memcpy_gbps"].values())

    machine = results["machine"]
    assert machine["cpus"] >= 1 and len(machine["load_average_start"]) == 3 and "load_average_end" in machine

    out = io.StringIO()
    Console(file=out, width=120).print(render(results))
    text = out.getvalue()
    assert "tandem/mp" in text and "spawn 8 actors (s)" in text and "n/a" in text
    assert "256 MiB shared array" in text and "one memcpy in one process" in text
    assert "FAIL" not in text and "PASS" not in text


def test_unknown_peer_is_rejected_with_the_allowed_values(capsys):
    with pytest.raises(ValueError, match="allowed values are tandem, ray, mp"):
        run(["tandem", "dask"], quick=True)
    with pytest.raises(SystemExit):
        main(["--peers", "tandem,dask"])
    assert "allowed values are tandem, ray, mp" in capsys.readouterr().err


def test_ray_is_skipped_with_a_note_when_it_is_not_importable(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    results = run(["ray"], quick=True)
    assert "ray is not importable" in results["peers"]["ray"]["skipped"]
    assert results["ratios"] == {} and [t["passed"] for t in results["targets"]] == [None] * 6
    out = io.StringIO()
    Console(file=out, width=120).print(render(results))
    assert "note: ray skipped" in out.getvalue()


@pytest.mark.timeout(120)
def test_transport_floor_measures_every_setup(capsys):
    from bench import transport_floor

    results = transport_floor.run(calls=20)
    assert list(results) == ["zmq, sleeping", "zmq, polling", "zmq, one CPU", "unix socket"]
    assert all(len(us) == 20 and (us > 0).all() for us in results.values())
    assert transport_floor.main(["--calls", "10"]) == 0
    assert "p50 / zmq sleeping" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        transport_floor.main(["--calls", "3"])

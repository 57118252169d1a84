"""bench.gae runs end to end on a small batch and reports both implementations."""

import json

from algorithms import compute_gae
from bench.gae import loop_gae, main, make_batch


def test_loop_peer_agrees_with_compute_gae():
    rewards, values, mask = make_batch(4, 300)
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
        ours = compute_gae(rewards.double(), values.double(), mask, gamma, lam)
        peer = loop_gae(rewards.double(), values.double(), mask.double(), gamma, lam)
        valid = mask.bool()
        assert (ours[0] - peer[0])[valid].abs().max().item() < 1e-10
        assert (ours[1] - peer[1])[valid].abs().max().item() < 1e-10


def test_bench_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gae.json"
    main(["--batch", "4", "--length", "256", "--repeats", "1", "--json", str(out)])
    table = capsys.readouterr().out
    assert "loop ms" in table and "compute_gae ms" in table and "ratio loop/ours" in table
    results = json.loads(out.read_text())
    assert [(r["gamma"], r["lam"]) for r in results] == [(1.0, 1.0), (1.0, 0.95)]
    for r in results:
        assert r["batch"] == 4 and r["length"] == 256
        assert r["loop_ms"] > 0 and r["compute_gae_ms"] > 0
        assert r["compute_gae_max_error"] < 1e-4 and r["loop_max_error"] < 1e-4

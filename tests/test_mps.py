"""The MPS daemon found or started (runtime.mps) and the launcher's choice for a side-by-side
run (ppo.gpu.side_by_side.choose), against tests/fakes/mps/nvidia-cuda-mps-control on PATH: a fake
that starts and stops like the real control program (its docstring says where it differs)."""

import json
import os
import sys
import types
from pathlib import Path

import pytest

import launch
from ppo.config import ConfigError
from ppo.config.schema import MPS_PRIORITIES
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.config.recipes import tiny_ppo
from ppo.gpu.side_by_side import check_roles, choose, verdict
from runtime import mps

FAKE_BIN = str(Path(__file__).parent / "fakes" / "mps")
SIDE = dict(train_async=True, colocate=True, num_gpus_per_node=1, actor_num_gpus_per_node=1,
            sglang_mem_fraction_static=0.4, offload_train_level="optimizer")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """The fake control program on PATH, its pipe and log folders under tmp_path, its calls logged."""
    monkeypatch.setenv("PATH", FAKE_BIN + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_MPS_LOG", str(tmp_path / "calls"))
    yield tmp_path / "calls"
    mps._command(FAKE_BIN + "/" + mps.CONTROL, str(tmp_path / "pipe"), str(tmp_path / "log"), "quit")


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_daemon_we_start_is_stopped_and_one_found_running_is_left_alone(fake_mps, tmp_path):
    daemon = mps.find_or_start()
    assert daemon.started and daemon.pipe_dir == str(tmp_path / "pipe") and daemon.log_dir == str(tmp_path / "log")
    assert calls(fake_mps) == ["get_server_list", "-d", "get_server_list"]  # asked, started, answered
    found = mps.find_or_start()
    assert not found.started
    found.stop()  # not ours: nothing sent
    assert calls(fake_mps)[-1] == "get_server_list"
    assert mps._answers(daemon.control, daemon.pipe_dir, daemon.log_dir)
    daemon.stop()
    assert calls(fake_mps)[-1] == "quit"
    assert not mps._answers(daemon.control, daemon.pipe_dir, daemon.log_dir)


def test_without_a_pipe_folder_named_ours_starts_in_a_private_one_and_removes_it(tmp_path, monkeypatch):
    """A daemon at CUDA's default folder would make every CUDA process started afterwards on the
    machine its client: ours goes to a private folder, which only our roles are told of."""
    monkeypatch.setenv("PATH", FAKE_BIN + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "default"))  # none answers there
    monkeypatch.setattr(mps.tempfile, "tempdir", str(tmp_path))
    daemon = mps.find_or_start()
    assert daemon.started and Path(daemon.pipe_dir).parent == tmp_path
    assert Path(daemon.pipe_dir).name.startswith("tandem-mps-") and daemon.log_dir == daemon.pipe_dir + "/log"
    assert daemon.client_env(percentage=50)["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
    assert not (tmp_path / "default").exists()
    daemon.stop()
    assert not Path(daemon.pipe_dir).exists()
    monkeypatch.setenv("FAKE_MPS_REFUSE", "1")  # a refused start leaves no folder behind either
    with pytest.raises(mps.MpsUnavailable, match="not permitted"):
        mps.find_or_start()
    assert not list(tmp_path.glob("tandem-mps-*"))


def test_each_role_gets_its_share_of_the_sms(fake_mps, tmp_path):
    daemon = mps.find_or_start()
    assert daemon.client_env(percentage=25) == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
                                                "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
                                                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                                                "CUDA_MPS_CLIENT_PRIORITY": "0"}
    assert daemon.client_env(percentage=100, priority="below_normal")["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    with pytest.raises(ValueError, match="must be in 1..100"):
        daemon.client_env(percentage=0)
    with pytest.raises(ValueError, match="priority='low': CUDA_MPS_CLIENT_PRIORITY must be one of"):
        daemon.client_env(percentage=50, priority="low")
    daemon.stop()


def test_no_control_program_or_a_refused_start_says_why(tmp_path, monkeypatch):
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control there
    with pytest.raises(mps.MpsUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
        mps.find_or_start(pipe_dir=str(tmp_path / "pipe"))
    monkeypatch.setenv("PATH", FAKE_BIN + os.pathsep + path)
    monkeypatch.setenv("FAKE_MPS_REFUSE", "1")
    with pytest.raises(mps.MpsUnavailable, match="-d` exited with 1 \\(not permitted\\?\\): fake MPS: cannot start "
                                                 "the control daemon: permission denied"):
        mps.find_or_start(pipe_dir=str(tmp_path / "pipe"), log_dir=str(tmp_path / "log"))


def side(**values):
    return ensure_valid(override(tiny_ppo(), **{**SIDE, **values}))


def test_the_sm_shares_are_flags_in_1_to_100_and_the_trainers_priority_one_of_mps_two():
    placement = side().placement  # the defaults measured fastest on the H200 (docs/benchmarks.md)
    assert (placement.engine_sm_percentage, placement.trainer_sm_percentage) == (100, 100)
    assert placement.trainer_mps_priority == "below_normal"
    assert set(MPS_PRIORITIES) == set(mps.PRIORITIES)
    with pytest.raises(ConfigError, match="trainer_mps_priority"):
        side(trainer_mps_priority="low")
    with pytest.raises(ConfigError, match="engine_sm_percentage"):
        side(engine_sm_percentage=0)
    with pytest.raises(ConfigError, match="trainer_sm_percentage"):
        side(trainer_sm_percentage=101)


def test_on_gpus_the_launcher_runs_side_by_side_under_mps_with_each_roles_share(fake_mps):
    cfg = side(fake_gpus=False, engine_sm_percentage=30, trainer_sm_percentage=100,
               trainer_mps_priority="below_normal")
    checked = []
    sm = choose(cfg, check=checked.append)  # every role's client computes right
    assert sm.cfg == cfg and sm.fallback is None and sm.daemon.started
    env = sm.role_env()
    assert checked == [env]  # each role's own client checked: its share and its priority
    assert env["engine"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["trainer"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert env["engine"]["CUDA_MPS_CLIENT_PRIORITY"] == "0" and env["trainer"]["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert sm.event() == {"mps": True, "started_daemon": True, "engine_sm_percentage": 30,
                          "trainer_sm_percentage": 100, "trainer_mps_priority": "below_normal", "fallback": None}
    sm.close()
    assert calls(fake_mps)[-1] == "quit"
    assert choose(override(cfg, train_async=False)) is None  # not side by side: nothing to decide


def test_where_mps_cannot_start_the_launcher_runs_the_synchronous_colocated_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    sm = choose(side(fake_gpus=False))
    assert not sm.cfg.rollout.train_async and sm.cfg.placement.colocate and sm.daemon is None
    assert sm.fallback == ("side by side needs MPS to split the GPU's SMs and it cannot start (nvidia-cuda-mps-control "
                           "is not on PATH (the NVIDIA driver's MPS tools are not installed)): running the synchronous "
                           "colocated plan (--colocate without --train-async)")
    assert sm.role_env() == {} and sm.event()["fallback"] == sm.fallback and not sm.event()["mps"]
    assert "fake GPUs have none to split" in choose(side()).fallback


def test_a_client_that_computes_wrong_stops_our_daemon_and_runs_the_synchronous_plan(fake_mps):
    why = "in the trainer's MPS client (75% of the SMs, below_normal) (98 SMs) 9 of 33 checks came out wrong"
    sm = choose(side(fake_gpus=False, trainer_sm_percentage=75), check=lambda envs: why)
    assert sm.daemon is None and not sm.cfg.rollout.train_async
    assert sm.fallback == why + ": running the synchronous colocated plan (--colocate without --train-async)"
    assert calls(fake_mps)[-1] == "quit"  # the daemon we started is stopped


def test_the_verdict_names_the_client_what_came_out_wrong_and_the_flags_to_change():
    where = "the trainer's MPS client (100% of the SMs, below_normal)"
    report = {"sms": 132, "rounds": 4, "checked": 33, "wrong": [["wgrad", 162, 4096, 24576], ["dgrad", 71, 4096, 4096]],
              "copy": [4098]}
    why = verdict(where, json.dumps(report) + "\n", "", 1)
    assert why.startswith("in the trainer's MPS client (100% of the SMs, below_normal) (132 SMs) 2 bf16 GEMMs and "
                          "1 onload copies of 33 checks came out wrong (the first: the wgrad GEMM of a linear of "
                          "162 x 4096 -> 24576), so the role would compute wrong results")
    assert why.endswith("choose other --engine-sm-percentage / --trainer-sm-percentage / --trainer-mps-priority")
    assert verdict(where, json.dumps({**report, "wrong": [], "copy": []}), "", 0) is None
    assert verdict(where, "", "Traceback ...\nRuntimeError: CUDA error: out of memory", 1) == (
        f"the compute check in {where} failed (exit 1): Traceback ...\nRuntimeError: CUDA error: out of memory")


def test_the_check_runs_in_each_roles_client_at_once_and_says_when_it_cannot_run(fake_mps, capsys):
    """The real check in its subprocesses, with the fake daemon's environment: on this machine
    there is no CUDA device, so it cannot run, and says so (its verdicts: tests/test_compute_check.py)."""
    daemon = mps.find_or_start()
    try:
        envs = {"engine": daemon.client_env(percentage=25),
                "trainer": daemon.client_env(percentage=100, priority="below_normal")}
        why = check_roles(envs)
    finally:
        daemon.stop()
    assert why == ("the compute check in the engine's MPS client (25% of the SMs, normal) could not run: "
                   "no CUDA device in this process")
    progress = capsys.readouterr().err.splitlines()
    what = ("checking GEMMs and the onload copy in the roles' MPS clients (engine at 25% of the SMs, normal, "
            "trainer at 100% of the SMs, below_normal)")
    assert progress[0] == f"[startup] {what} ..."
    assert progress[1].startswith(f"[startup] {what}: done in ")


def test_the_launcher_says_so_in_one_line_and_trains_the_synchronous_plan(monkeypatch, capsys):
    received = []
    loop = types.ModuleType("ppo.loop")
    loop.train = lambda cfg, sm=None: received.append((cfg, sm))
    loop.TrainerDied = RuntimeError
    monkeypatch.setitem(sys.modules, "ppo.loop", loop)
    launch.main(["--train-async", "--num-gpus-per-node", "1", "--actor-num-gpus-per-node", "1",
                 "--sglang-mem-fraction-static", "0.4",
                 "--offload-train-level", "optimizer"])  # tiny_ppo: colocated, fake GPUs
    [(cfg, sm)] = received
    assert not cfg.rollout.train_async and sm.fallback
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tandem: {sm.fallback}"]

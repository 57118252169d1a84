"""--rm-type remote_rm against a real HTTP server on localhost (http.server in a thread): the
request miles sends, the answer's forms, and a slow, failing, trickling or absent service, each
ending in a scored sample within its bound, never a hang."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from roles.reward.remote import service_problem
from roles.reward.config import ScorerConfig
from roles.reward.scorer import Scorer


class Service:
    """A reward service whose behaviour the test sets: `answer(body, attempt) -> (status, bytes, delay_s)`."""

    def __init__(self, answer):
        self.answer = answer
        self.bodies: list[dict] = []
        self.attempts = 0
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service._lock:
                    service.bodies.append(body)
                    service.attempts += 1
                    attempt = service.attempts
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                try:
                    status, payload, delay = service.answer(body, attempt)
                    time.sleep(delay)
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up at its deadline
                finally:
                    with service._lock:
                        service.in_flight -= 1

            def log_message(self, *args):
                pass

        # a listen backlog for 32 clients at once (socketserver's default of 5 resets the rest)
        server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})
        self.server = server_class(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/reward"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    services = []

    def start(answer):
        services.append(Service(answer))
        return services[-1]

    yield start
    for s in services:
        s.close()


def sample(index, response, label="7"):
    return {"index": index, "prompt": f"p{index}", "response": response, "label": label, "metadata": {"k": 1}}


def exact(body, attempt):
    return 200, json.dumps(float(body["response"] == body["label"])).encode(), 0.0


def scorer(url, **kwargs):
    kwargs.setdefault("timeout_s", 2.0)
    return Scorer(ScorerConfig(rm_type="remote_rm", rm_url=url, **kwargs))


@pytest.mark.timeout(30)
def test_each_sample_is_posted_in_miles_format_and_scored_in_order(serve):
    service = serve(exact)
    with scorer(service.url) as s:
        out = s.score([sample(i, r) for i, r in enumerate(["7", "8", "7", "x"])])
        assert [o["index"] for o in out] == [0, 1, 2, 3]
        assert [o["reward"] for o in out] == [1.0, 0.0, 1.0, 0.0]
        assert {o["status"] for o in out} == {"ok"}
        assert s.stats() == {"num_scored": 4, "num_errors": 0, "num_timeouts": 0, "num_retries": 0}
    assert sorted(service.bodies, key=lambda b: b["prompt"])[1] == {"prompt": "p1", "response": "8", "label": "7"}


@pytest.mark.timeout(30)
def test_reward_key_picks_the_reward_from_a_dict_answer(serve):
    service = serve(lambda body, attempt: (200, json.dumps({"score": 0.25, "accuracy": 1}).encode(), 0.0))
    with scorer(service.url, reward_key="score") as s:
        assert s.score([sample(0, "7")])[0]["reward"] == 0.25
    with scorer(service.url) as s:  # a dict without --reward-key is the sample's error, named
        out = s.score([sample(0, "7")])[0]
        assert out["status"] == "error" and "--reward-key" in out["error"]
    with scorer(service.url, reward_key="nope") as s:
        assert "'nope'" in s.score([sample(0, "7")])[0]["error"]


@pytest.mark.timeout(30)
def test_a_failing_service_is_retried_with_backoff_then_the_sample_scores_zero(serve):
    flaky = serve(lambda body, attempt: (503 if attempt <= 2 else 200, b"1.5", 0.0))
    with scorer(flaky.url, max_retries=2) as s:
        out = s.score([sample(0, "7")])[0]
        assert (out["reward"], out["status"]) == (1.5, "ok") and s.stats()["num_retries"] == 2
    broken = serve(lambda body, attempt: (500, b"boom", 0.0))
    with scorer(broken.url, max_retries=1) as s:
        t0 = time.monotonic()
        out = s.score([sample(0, "7")])[0]
        assert (out["reward"], out["status"]) == (0.0, "error") and "HTTP 500" in out["error"]
        assert time.monotonic() - t0 < 2.0  # one backoff of 0.1 s, no waiting on a deadline
    assert broken.attempts == 2
    assert s.stats()["num_errors"] == 1


@pytest.mark.timeout(30)
def test_a_client_error_or_a_non_reward_answer_is_not_retried(serve):
    for status, payload, message in [(400, b"bad request", "HTTP 400"), (200, b"<html>", "not JSON"),
                                     (200, b'"1.0"', "expected a float"), (200, b"NaN", "finite")]:
        service = serve(lambda body, attempt, status=status, payload=payload: (status, payload, 0.0))
        with scorer(service.url, max_retries=3) as s:
            out = s.score([sample(0, "7")])[0]
        assert out["status"] == "error" and message in out["error"], (status, payload, out)
        assert service.attempts == 1


@pytest.mark.timeout(30)
def test_a_slow_service_times_out_per_attempt_and_the_next_batch_is_served(serve):
    slow = {"on": True}
    service = serve(lambda body, attempt: (200, b"1.0", 5.0 if slow["on"] else 0.0))
    with scorer(service.url, timeout_s=0.3, max_retries=1) as s:
        t0 = time.monotonic()
        out = s.score([sample(i, "7") for i in range(3)])
        elapsed = time.monotonic() - t0
        assert [o["status"] for o in out] == ["timeout"] * 3 and {o["reward"] for o in out} == {0.0}
        assert "within 0.3 s" in out[0]["error"]
        assert elapsed < 2.0, elapsed  # 2 attempts x 0.3 s + a 0.1 s backoff, not the service's 5 s
        slow["on"] = False
        assert [o["status"] for o in s.score([sample(0, "7")])] == ["ok"]
        assert s.stats()["num_timeouts"] == 3


@pytest.mark.timeout(30)
def test_a_trickling_answer_is_cut_at_the_deadline():
    """Headers at once, then one byte every 0.1 s: each read returns in time, the answer never
    ends; the whole attempt's deadline still holds."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b" ")
            except OSError:
                break
            time.sleep(0.1)
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        with scorer(url, timeout_s=0.5, max_retries=0) as s:
            t0 = time.monotonic()
            out = s.score([sample(0, "7")])[0]
            assert out["status"] == "timeout" and time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        listener.close()


@pytest.mark.timeout(30)
def test_requests_in_flight_are_bounded(serve):
    service = serve(lambda body, attempt: (200, b"1.0", 0.1))
    with scorer(service.url, max_concurrency=3) as s:
        out = s.score([sample(i, "7") for i in range(12)])
    assert {o["status"] for o in out} == {"ok"}
    assert service.max_in_flight == 3  # reached, and never passed


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_a_service_that_goes_down_scores_zero_fast_and_a_down_one_is_named_at_start(serve):
    url = f"http://127.0.0.1:{free_port()}/reward"
    assert "cannot be reached" in service_problem(url) and url in service_problem(url)
    assert "http://" in service_problem("localhost:8000")
    with scorer(url, max_retries=2) as s:
        t0 = time.monotonic()
        out = s.score([sample(0, "7"), sample(1, "7")])
        assert {o["status"] for o in out} == {"error"} and "Connection refused" in out[0]["error"]
        assert time.monotonic() - t0 < 2.0  # refused at once, retried twice (0.1 + 0.2 s)
    assert service_problem(serve(exact).url) is None


def test_remote_rm_needs_its_url():
    with pytest.raises(ValueError, match="rm_url"):
        Scorer(ScorerConfig(rm_type="remote_rm"))
    with pytest.raises(ValueError, match="http://"):
        Scorer(ScorerConfig(rm_type="remote_rm", rm_url="ftp://x/"))


@pytest.mark.timeout(120)
def test_launch_refuses_a_service_that_is_down_in_one_line_exit_2_before_anything_starts(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    url = f"http://127.0.0.1:{free_port()}/reward"
    proc = subprocess.run([sys.executable, str(root / "launch.py"), "--recipe", "tiny_ppo", "--rm-type", "remote_rm",
                           "--rm-url", url, "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"tandem: --rm-url {url}: the reward service cannot be reached (Connection refused); start it, or fix the URL"]
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_tiny_ppo_scores_through_the_service_and_counts_its_failures(tmp_path, serve):
    """The scorer role on the real runtime: every sample goes to the service; the ones it fails
    score 0 and are counted in rollout/reward_failures, and the run goes on."""
    from ppo.config.serialize import override
    from ppo.config.validate import ensure_valid
    from ppo.loop import train
    from ppo.config.recipes import tiny_ppo

    def grade(body, attempt):  # tiny_exact, except that a prompt with a 3 in it always fails
        if "3" in body["prompt"]:
            return 500, b"down for this one", 0.0
        return 200, json.dumps({"exact": float(body["response"].strip() == body["label"])}).encode(), 0.0

    service = serve(grade)
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=1, rollout_batch_size=16,
                                num_critic_only_steps=0, rm_type="remote_rm", rm_url=service.url,
                                reward_key="exact", rm_max_retries=1, eval_prompt_data=None, eval_interval=None))
    history = train(cfg)
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples" / "rollout_00000.jsonl").read_text().splitlines()]
    failing = [s for s in samples if "3" in s["prompt"]]
    assert len(service.bodies) == len(samples) + len(failing)  # each failing one tried twice
    assert history[0]["rollout/reward_failures"] == len(failing) > 0
    assert all(s["reward"] == 0.0 for s in failing)

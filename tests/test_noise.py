"""Library noise goes to RUN_DIR/logs/warnings.log; our own warnings still reach the console."""

from __future__ import annotations

import logging
import warnings

import pytest

from runtime import Supervisor
from runtime.noise import LOG_NAME, route_library_noise
from tests.actors import Noisy, megatron_noise

pytestmark = pytest.mark.timeout(60)


def test_a_role_logs_library_noise_and_shows_its_own_warnings(tmp_path, capfd):
    with Supervisor(tmp_path / "run") as sup:
        sup.spawn("noisy", Noisy).warn("tandem: reward file has no label column")
    err = capfd.readouterr().err  # the role writes to the console's stderr, which it inherits
    assert "tandem: reward file has no label column" in err
    assert "Apex" not in err and "deprecated" not in err
    log = (tmp_path / "run" / LOG_NAME).read_text()
    assert "noisy (pid " in log
    assert "UserWarning: Apex is not installed. Falling back to Torch Norm" in log
    assert "DeprecationWarning: the old layer spec is deprecated" in log
    assert "no label column" not in log


def test_the_driver_logs_library_noise_until_closed(tmp_path):
    megatron_log = logging.getLogger("megatron.core.utils")
    with warnings.catch_warnings(record=True) as console:  # what the console would show
        warnings.simplefilter("default")
        route = route_library_noise(tmp_path, source="supervisor")
        megatron_noise()
        megatron_log.warning("Transformer Engine is not installed")
        warnings.warn("a deprecation, from anyone", FutureWarning)
        warnings.warn("tandem: a warning of ours")
        route.close()
        warnings.warn("tandem: after close", FutureWarning)
    assert [str(w.message) for w in console] == ["tandem: a warning of ours", "tandem: after close"]
    log = (tmp_path / LOG_NAME).read_text()
    for text in ("supervisor (pid ", "Apex is not installed", "the old layer spec is deprecated",
                 "megatron.core.utils WARNING: Transformer Engine is not installed", "a deprecation, from anyone"):
        assert text in log
    assert "tandem:" not in log
    assert logging.getLogger("megatron").propagate  # the logger is as it was



def test_a_syntax_warning_compiling_a_library_module_is_logged(tmp_path):
    """Compiling a library module warns from the importer's frame, naming the library's file
    (megatron-core 0.19.2's kv_block_allocator.py on the H200): the file decides."""
    with warnings.catch_warnings(record=True) as console:
        warnings.simplefilter("default")
        route = route_library_noise(tmp_path, source="supervisor")
        # as the compiler warns (Python 3.12 on the H200): SyntaxWarning, the module's file
        for path in ("/site/megatron/core/kv_block_allocator.py", "/work/ppo/ours.py"):
            warnings.warn_explicit("invalid escape sequence '\\-'", SyntaxWarning, path, 426)
        route.close()
    assert [w.filename for w in console] == ["/work/ppo/ours.py"]
    assert "megatron/core/kv_block_allocator.py:426: SyntaxWarning" in (tmp_path / LOG_NAME).read_text()


def test_routes_nest_and_close_in_any_order(tmp_path):
    before = warnings.showwarning
    first = route_library_noise(tmp_path / "a", source="first")
    second = route_library_noise(tmp_path / "b", source="second")
    megatron_noise()  # the newest open route gets it
    first.close()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        megatron_noise()
    second.close()
    assert not (tmp_path / "a" / LOG_NAME).exists()
    assert (tmp_path / "b" / LOG_NAME).read_text().count("Apex is not installed") == 2
    assert warnings.showwarning is before
    assert logging.getLogger("megatron").propagate and not logging.getLogger("megatron").handlers


def test_a_library_console_handler_added_while_routed_is_left_off(tmp_path):
    # transformers adds its own stderr handler to its logger when first imported
    import sys

    library = logging.getLogger("transformers")
    # earlier tests in this process may have turned transformers' verbosity down (ppo.setup.job) or
    # disabled the loggers that existed then (logging.config): a fresh child, its parent as new
    saved = library.level, library.disabled
    library.setLevel(logging.WARNING)  # setLevel, not .level: it clears the loggers' cached decisions
    library.disabled = False
    route = route_library_noise(tmp_path, source="noisy")
    console = logging.StreamHandler(sys.stderr)
    library.addHandler(console)
    logging.getLogger("transformers.test_noise").warning("Some weights were not initialized")
    route.close()
    library.setLevel(saved[0])
    library.disabled = saved[1]
    assert console not in library.handlers
    assert "transformers.test_noise WARNING: Some weights were not initialized" in (
        tmp_path / LOG_NAME).read_text()

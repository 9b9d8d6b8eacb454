"""Issue 16: after a relay restart, torchrun's agents printed ~28 lines (a DistNetworkError with C++ frames)
from their exit barrier although the run succeeded: the run's store had gone with the old relay. With the
tandem-relay backend installed, that is one line. Drives torch's own SimpleElasticAgent._exit_barrier
with a store that fails as the dead relay store does."""
import logging
import types

from torch.distributed import DistNetworkError
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

from launch.torchrun.relay_rendezvous import quiet_exit_barrier


class DeadStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise DistNetworkError("failed to recv, got 0 bytes\nException raised from recvBytes at socket.cpp:678\n"
                                   "frame #0: c10::Error::Error(...) + 0x96\nframe #1: ... + 0x5\nframe #2: ... + 0x7")
        return fail


def exit_barrier_output(capsys) -> str:
    agent = types.SimpleNamespace(_store=DeadStore(), _exit_barrier_timeout=1, _in_exit_barrier=False,
                                  _worker_group=types.SimpleNamespace(group_world_size=2, state="SUCCEEDED"))
    logger = logging.getLogger("torch.distributed.elastic.agent.server.api")
    handler = logging.StreamHandler()  # stderr, as torchrun's agent logs
    logger.addHandler(handler)
    try:
        SimpleElasticAgent._exit_barrier(agent)
    finally:
        logger.removeHandler(handler)
    return capsys.readouterr().err


def test_the_exit_barrier_after_a_relay_restart_is_one_line(capsys):
    assert "frame #1" in exit_barrier_output(capsys)  # torch's own logging: the whole page
    quiet_exit_barrier()
    quiet_exit_barrier()  # installed once however often torchrun creates a handler
    text = exit_barrier_output(capsys)
    assert text.count("\n") == 1 and "exit barrier was skipped" in text and "DistNetworkError" in text, text

"""torchrun's end when --max_restarts are used up: one line of its own after the ranks' lines, not its
ChildFailedError traceback. Each attempt's ranks have said why they stopped (`tandem[rank N]: ...`); what is left
to say is that torchrun will not start them again. Called from torchrun's excepthook
(launch.torchrun.relay_rendezvous.quiet_launcher_exits), in torchrun's own process."""
from __future__ import annotations


def max_restarts(argv: list[str]) -> int:
    """--max_restarts as torchrun itself reads it from its command line (0 when it cannot tell)."""
    from torch.distributed.run import get_args_parser
    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:  # not torchrun's command line
        return 0
    return args.max_restarts


def used_up_line(e: BaseException, argv: list[str]) -> str | None:
    """The line torchrun ends with when the workers failed on the last of --max_restarts > 0 attempts; None for
    any other end (a run without restarts keeps torchrun's own report)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    restarts = max_restarts(argv) if isinstance(e, ChildFailedError) else 0
    if restarts == 0:
        return None
    failed = ", ".join(f"rank {rank} (exit {f.exitcode})" for rank, f in sorted(e.failures.items()))
    return (f"tandem: {failed} failed on the last of {restarts + 1} attempts (--max_restarts={restarts} used up); "
            "each rank's line above says why")

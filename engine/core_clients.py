"""The engine core serving several front-end processes (`--api-server-count N`, as vLLM's):
one pipe per API process, commands taken from whichever pipe has one, and every message the
core emits routed to the process that owns it.

In: `engine.messages` commands over N pipes (`ClientPipes`, `EngineCoreProc`'s command
source); a pipe that closes (its API process exited) or sends `Stop` (it shuts down) becomes
`AbortRequests` of that process's requests, and the last one to close `Stop`; `AbortAll`
aborts the sender's requests alone. Out (`ClientOutbox`, `EngineCoreProc`'s `emit`):
`Acknowledged` to the sender of the command; each `EngineCoreOutputs` split by request owner,
the step's engine-wide stats and the scheduler snapshot to front end 0 alone (as vLLM's engine
core returns scheduler stats to one front end), so that the Prometheus metrics the processes
share count each step once; `Ready`, `Dead` and `LoraAdapters` to every front end.
"""

from __future__ import annotations

from multiprocessing.connection import Connection, wait

from engine.messages import AbortAll, AbortRequests, Acknowledged, AddRequest, Stop
from engine.outputs import EngineCoreOutputs, StepStats

_PRUNE_EVERY = 256          # AddRequests between prunings of finished requests' owners


class ClientPipes:
    """`EngineCoreProc`'s command source over N pipes; `client` is the index of the pipe the
    last command came from, `owners` maps request ids to it."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns: dict[Connection, int] = {c: i for i, c in enumerate(conns)}
        self.owners: dict[str, int] = {}
        self.client = 0
        self._ready: list[Connection] = []
        self._adds = 0
        self.live_requests = None       # () -> set of request ids the core holds (pruning)

    def wait(self) -> None:
        """Block until some pipe has a command (or closed)."""
        if not self._ready and self.conns:
            self._ready = wait(list(self.conns))

    def poll(self) -> bool:
        """Whether a command is there now (a closed pipe counts: it becomes a command)."""
        if not self._ready:
            if not self.conns:
                return True                     # every front end is gone: Stop
            self._ready = wait(list(self.conns), timeout=0)
        return bool(self._ready)

    def recv(self):
        """The next command; a closed pipe's `AbortRequests` of its requests; `Stop` once no
        pipe is left."""
        if not self.conns:
            return Stop()
        conn = self._ready.pop()
        self.client = index = self.conns[conn]
        try:
            command = conn.recv()
        except (EOFError, OSError):             # its API process exited
            command = None
        if command is None or isinstance(command, Stop):    # it left (or is leaving)
            return self._drop(conn, index)
        if isinstance(command, AbortAll):      # one API process draining: its requests only
            return AbortRequests(self._owned(index))
        if isinstance(command, AddRequest):
            self._adds += 1
            if self._adds % _PRUNE_EVERY == 0 and self.live_requests is not None:
                self._prune()               # before this one's owner: it is not added yet
            self.owners[command.request_id] = index
        return command

    def _drop(self, conn: Connection, index: int):
        """Forget a front end that left: close its pipe (its reader sees the end), and abort
        its requests; `Stop` when it was the last."""
        del self.conns[conn]
        conn.close()
        self._ready = [c for c in self._ready if c is not conn]
        gone = self._owned(index)
        for rid in gone:
            del self.owners[rid]
        return AbortRequests(gone) if self.conns else Stop()

    def _owned(self, index: int) -> list[str]:
        """The ids of front end `index`'s requests."""
        return [rid for rid, owner in self.owners.items() if owner == index]

    def _prune(self) -> None:
        """Forget the owners of requests the core no longer holds."""
        live = {rid.partition("#")[0] for rid in self.live_requests()}   # forks: "parent#i"
        self.owners = {rid: i for rid, i in self.owners.items() if rid in live}


class ClientOutbox:
    """`EngineCoreProc`'s `emit` over N pipes, routed by `pipes` (its `client` and `owners`).
    A pipe whose process has gone is skipped."""

    def __init__(self, conns: list[Connection], pipes: ClientPipes) -> None:
        self.conns, self.pipes = conns, pipes

    def _send(self, index: int, message) -> None:
        try:
            self.conns[index].send(message)
        except (OSError, ValueError):          # that front end exited (or its pipe closed)
            pass

    def __call__(self, message) -> None:
        if isinstance(message, Acknowledged):
            self._send(self.pipes.client, message)
        elif isinstance(message, EngineCoreOutputs):
            for index, part in enumerate(split_outputs(message, self.pipes.owners,
                                                       len(self.conns))):
                if part is not None:
                    self._send(index, part)
        else:                                   # Ready, Dead, LoraAdapters: everyone's
            for index in range(len(self.conns)):
                self._send(index, message)


def split_outputs(out: EngineCoreOutputs, owners: dict[str, int],
                  n: int) -> list[EngineCoreOutputs | None]:
    """`out` as one `EngineCoreOutputs` per front end (None: nothing for it): request outputs,
    prompt logprobs and first-scheduled times by owner (a forked choice by its parent's);
    `stats` engine-wide for front end 0, and for the others with `engine_wide` False when they
    have outputs (to fill their requests' token counts and finishes); `snapshot` to 0 alone."""
    parts = [EngineCoreOutputs() for _ in range(n)]

    def owner(rid: str) -> int:             # a forked choice's id is "parent#index"
        i = owners.get(rid)
        return owners.get(rid.partition("#")[0], 0) if i is None else i

    for o in out.outputs:
        parts[owner(o.request_id)].outputs.append(o)
    for entry in out.scheduled:
        parts[owner(entry[0])].scheduled.append(entry)
    for rid, value in (out.prompt_logprobs or {}).items():
        part = parts[owner(rid)]
        if part.prompt_logprobs is None:
            part.prompt_logprobs = {}
        part.prompt_logprobs[rid] = value
    for part in parts[1:]:
        if out.stats is not None and _has_requests(part):
            part.stats = StepStats(0, 0, 0, 0.0, 0.0, engine_wide=False)
    parts[0].stats, parts[0].snapshot = out.stats, out.snapshot
    return [p if _has_requests(p) or p.stats is not None or p.snapshot is not None else None
            for p in parts]


def _has_requests(part: EngineCoreOutputs) -> bool:
    """Whether a front end's part carries anything of its requests."""
    return bool(part.outputs or part.scheduled or part.prompt_logprobs)

"""`castwise run` under torchrun / accelerate launch: each distinct rank program audited once,
and rank 0 reporting for all, each finding naming its ranks.

Every rank runs the script watched. At a model's first call a rank fingerprints its program
(``castwise.distributed.programs.signature``: module classes, local parameter shapes and dtypes,
what it is handed, plus the policy) and claims it in a key-value store; the first rank of each
program audits it and leaves the report there; each rank says which program it ran. Rank 0 joins
the reports of the n-th model of every rank (one per distinct program, with its ranks) and prints
that one report; the other ranks print nothing of castwise's.

The store is the elastic agent's: torchrun (and accelerate launch, which runs torchrun's launcher)
serves a TCPStore at ``MASTER_ADDR:MASTER_PORT`` for the job's life and says so with
``TORCHELASTIC_USE_AGENT_STORE=True`` (torch/distributed/elastic/agent/server/local_elastic_agent.py:
_start_workers; torch/distributed/rendezvous.py makes every worker its client the same way). Why
not the script's process group (``gather_object``): that is a collective every rank must enter at
the same point, and a pipeline's stages reach their first forward at different times (stage 1 is
in its recv while stage 0 audits), so it deadlocks; it would also add calls to the user's NCCL
sequence. Store reads and writes are not collectives: no rank waits on another's progress, and
they work before the script makes its group and after it destroys it. Keys are prefixed with the
agent's restart count (an elastic restart starts afresh). Without the agent's store (RANK set by
hand, mpirun) there is nothing shared to meet through: rank 0 audits its own program alone and
a note says so.

Rank 0 prints a model's joined report from a thread as soon as every rank has said what it ran
(its main thread may be blocked in the script's own recv), else at the script's end. A rank whose
program has an error waits (bounded) for rank 0 to have printed before its forward goes on: a
rank that then crashes makes torchrun stop the others, rank 0 included.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from castwise.auditor.programs import merge_ranks
from castwise.report import Report

__all__ = ["Meeting", "launched_rank", "meeting_from_env"]

WAIT_DONE_S = 600.0  # rank 0, at its script's end: how long the other ranks may take to finish theirs
WAIT_SHOWN_S = 60.0  # a rank with an error: how long it waits for rank 0 to have printed it
_POLL_S = 0.2


def launched_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as torchrun and accelerate launch set it (``RANK``, else
    ``LOCAL_RANK`` on one node); 0 when launched on its own or the value is not a number."""
    env = os.environ if environ is None else environ
    for var in ("RANK", "LOCAL_RANK"):
        value = env.get(var, "").strip()
        if value:
            return int(value) if value.isdigit() else 0
    return 0


def meeting_from_env(
    on_report: Callable[[str, Report], None] | None, environ: Mapping[str, str] | None = None
) -> Meeting | None:
    """The meeting of this job's ranks through torchrun's agent store; None when the process was
    not launched by torchrun's agent (or runs alone)."""
    env = os.environ if environ is None else environ
    world = env.get("WORLD_SIZE", "1").strip()
    if not world.isdigit() or int(world) < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return None

    def connect() -> Any:
        from datetime import timedelta

        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=WAIT_DONE_S))

    prefix = f"castwise/run/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return Meeting(connect, launched_rank(env), int(world), prefix, on_report)


@dataclass
class Meeting:
    """One rank's side of the meeting (see the module's docstring). ``connect`` makes a store
    client (the reporting thread has its own); ``on_report`` (rank 0) sees each joined report."""

    connect: Callable[[], Any]
    rank: int
    world: int
    prefix: str
    on_report: Callable[[str, Report], None] | None = None
    reports: list[tuple[str, Report]] = field(default_factory=list)  # rank 0: the joined ones
    _store: Any = None
    _count: int = 0  # this rank's models so far
    _shown: int = 0  # rank 0: models whose joined report is out
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._store = self.connect()
        if self.rank == 0:
            self._thread = threading.Thread(target=self._watch, name="castwise-ranks", daemon=True)
            self._thread.start()

    def audit(self, name: str, program: str, run_audit: Callable[[], Report | None]) -> Report | None:
        """This rank's n-th model, whose program ``program`` describes: audited here if no rank
        claimed the same program first (else None), and said in the store."""
        k, self._count = self._count, self._count + 1
        fp = hashlib.sha1(program.encode()).hexdigest()[:16]
        first = int(self._store.add(self._key("claim", k, fp), 1)) == 1
        report = run_audit() if first else None
        if first:
            self._store.set(self._key("report", k, fp), pickle.dumps(report))
        self._store.set(self._key("rank", k, self.rank), json.dumps({"name": name, "fp": fp}))
        if report is not None and report.errors and self.rank != 0:
            # its forward may crash next, and torchrun then stops rank 0 too: let rank 0 print first
            self._wait([self._key("shown", k)], WAIT_SHOWN_S)
        return report

    def finish(self) -> None:
        """The script ended on this rank: say how many models it ran; rank 0 waits for the
        others to end and prints what is left (a rank that never said: "reported nothing")."""
        self._store.set(self._key("done", self.rank), str(self._count))
        if self.rank != 0:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._wait([self._key("done", r) for r in range(self.world)], WAIT_DONE_S)
        while self._show_next(self._store, final=True):
            pass

    # -- rank 0 ------------------------------------------------------------------------------------

    def _watch(self) -> None:
        store = self.connect()
        while not self._stop.is_set():
            if not self._show_next(store, final=False):
                self._stop.wait(_POLL_S)

    def _show_next(self, store: Any, final: bool) -> bool:
        """Print the next model's joined report if every rank has said what it ran (``final``:
        whatever the ranks said); False when there is nothing (more) to print."""
        with self._lock:
            k = self._shown
            ranks: dict[int, dict[str, str]] = {}
            for r in range(self.world):
                key = self._key("rank", k, r)
                if store.check([key]):
                    ranks[r] = json.loads(store.get(key))
                elif not final and not self._ended_before(store, r, k):
                    return False
            if not ranks:
                return False
            by_fp: dict[str, list[int]] = {}
            for r, said in ranks.items():
                by_fp.setdefault(said["fp"], []).append(r)
            parts = []
            for fp, members in by_fp.items():
                key = self._key("report", k, fp)
                if not store.check([key]):  # its first rank is still auditing it
                    if not final:
                        return False
                    continue
                report = pickle.loads(store.get(key))
                if report is not None:
                    parts.append((members, report))
            self._shown += 1
            store.set(self._key("shown", k), "1")
            if not parts:
                return True
            name = ranks.get(0, next(iter(ranks.values())))["name"]
            joined = merge_ranks(parts, self.world)
            self.reports.append((name, joined))
            if self.on_report is not None:
                self.on_report(name, joined)
            return True

    def _ended_before(self, store: Any, rank: int, k: int) -> bool:
        key = self._key("done", rank)
        return bool(store.check([key])) and int(store.get(key)) <= k

    def _wait(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def _key(self, *parts: object) -> str:
        return "/".join((self.prefix, *(str(p) for p in parts)))

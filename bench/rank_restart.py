"""How long killed data-parallel ranks take to serve again: one rank, and two ranks killed one after the other
inside the first one's backoff.

Starts ``DataParallelDriver`` over reference-engine workers (independent ranks, default restart policy: 0.5 s
backoff), SIGKILLs worker processes and measures, on the event loop's clock, the time from the first kill until
every rank is up again (capped at ``--cap`` seconds: "never" in the table).

Usage: ``python bench/rank_restart.py --trials 3``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics

from backends.config import ReferenceBackendConfig
from backends.reference.backend import load_tokenizer
from backends.workers.driver import DataParallelDriver
from backends.workers.launch import WorkerPlan

FACTORY = "backends.reference.backend:build_rank_engine"


async def trial(victims: list[int], gap: float, cap: float) -> float | None:
    """Seconds from the first kill until every rank is up with a new process; None if not within ``cap``."""
    options = ReferenceBackendConfig(name="restart", data_parallel_size=2).model_dump(mode="json")
    driver = DataParallelDriver("restart", WorkerPlan(2, FACTORY, options), load_tokenizer)
    await driver.start()
    try:
        loop = asyncio.get_running_loop()
        killed = set()
        start = loop.time()
        for index, rank in enumerate(victims):
            process = driver.ranks[rank].process
            assert process is not None
            killed.add(process.pid)
            os.kill(process.pid, signal.SIGKILL)
            if index + 1 < len(victims):
                await asyncio.sleep(gap)  # the second kill falls inside the first one's backoff
        while loop.time() - start < cap:
            if all(rank.state == "up" and rank.pid not in killed for rank in driver.ranks):
                return loop.time() - start
            await asyncio.sleep(0.01)  # the resolution of the measurement, not a synchronization
        return None
    finally:
        await driver.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between the two kills")
    parser.add_argument("--cap", type=float, default=40.0)
    args = parser.parse_args()
    rows = []
    for name, victims in (("one rank killed", [0]), ("two ranks killed, 0.1 s apart", [0, 1])):
        times = [await trial(victims, args.gap, args.cap) for _ in range(args.trials)]
        back = [t for t in times if t is not None]
        rows.append(
            {
                "scenario": name,
                "back_within_cap": f"{len(back)}/{len(times)}",
                "median_seconds": round(statistics.median(back), 2) if back else None,
            }
        )
    print("| scenario | all ranks back within cap | median time to all up |")
    print("| --- | ---: | ---: |")
    for row in rows:
        median = "never" if row["median_seconds"] is None else f"{row['median_seconds']} s"
        print(f"| {row['scenario']} | {row['back_within_cap']} | {median} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    asyncio.run(main())

"""The `overall_load` a service reports through `Status` (0..100 normal, 255 = cannot serve).

It is the CPU share of this process over the last sampling period (as a percentage of one core,
which is what one asyncio event loop can use), raised when the event loop lags behind its timer,
and 255 while the service is not serving (starting or shutting down).
"""

from __future__ import annotations

import asyncio
import time

from shared.supervision import cancel_and_wait

UNSERVICEABLE = 255
SAMPLE_PERIOD_S = 1.0


class LoadMonitor:
    def __init__(self, period_s: float = SAMPLE_PERIOD_S) -> None:
        self._period_s = period_s
        self._load = 0
        self.serviceable = False
        self._task: asyncio.Task[None] | None = None

    @property
    def overall_load(self) -> int:
        return self._load if self.serviceable else UNSERVICEABLE

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample_forever(), name="load-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _sample_forever(self) -> None:
        last_wall, last_cpu = time.monotonic(), time.process_time()
        while True:
            await asyncio.sleep(self._period_s)
            wall, cpu = time.monotonic(), time.process_time()
            elapsed = max(wall - last_wall, 1e-9)
            cpu_percent = 100.0 * (cpu - last_cpu) / elapsed
            # Time beyond the requested sleep is time the loop could not run us: a busy loop.
            lag_percent = 100.0 * max(0.0, elapsed - self._period_s) / self._period_s
            self._load = min(100, round(max(cpu_percent, lag_percent)))
            last_wall, last_cpu = wall, cpu

"""A lagging consumer gets merged outputs: text and tokens concatenated, nothing lost."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from omlx_logprobs.transport.collector import RequestOutputCollector
from omlx_logprobs.types import FinishReason, RequestOutput


def test_outputs_put_while_the_consumer_lags_are_merged_in_order() -> None:
    async def main() -> list[RequestOutput]:
        c = RequestOutputCollector(asyncio.get_running_loop())
        n = 200

        def engine() -> None:
            for i in range(n):
                last = i == n - 1
                c.put(
                    RequestOutput(
                        "r",
                        token_ids=np.array([i], np.int32),
                        text=f"{i},",
                        finished=last,
                        finish_reason=FinishReason.LENGTH if last else None,
                    )
                )

        threading.Thread(target=engine).start()
        got = [await c.get()]
        while not got[-1].finished:
            await asyncio.sleep(0.001)  # lag behind the producer
            got.append(await c.get())
        return got

    got = asyncio.run(main())
    assert "".join(o.text for o in got) == "".join(f"{i}," for i in range(200))
    assert np.concatenate([o.token_ids for o in got]).tolist() == list(range(200))
    assert len(got) < 200  # some merging happened

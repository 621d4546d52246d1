"""A lagging consumer gets merged outputs: text concatenated, token range widened, nothing lost."""

from __future__ import annotations

import asyncio
import threading

from omlx_logprobs.output.collector import RequestOutputCollector
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
                        f"{i},",
                        i,
                        i + 1,
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
    assert got[0].first_token == 0 and got[-1].end_token == 200
    assert all(a.end_token == b.first_token for a, b in zip(got, got[1:]))
    assert len(got) < 200  # some merging happened

"""`omlx-logprobs serve` with the model runner on its GPU path (extraction on the device, a step
processed beside the next launch) on the CPU backend, for servers started as a process. With
`--engine thread` the engine runs in this process, where the flag is set."""

import omlx_logprobs.runner.plan as plan
from omlx_logprobs.cli import main

plan.FORCE_GPU_PATH = True
main()

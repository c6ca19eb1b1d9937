"""Which of torch.compile's signals move on this machine's torch: dynamo's frame counter and its compile
callbacks (what the LoadBalanceMonitor reads to flag compiling steps). Prints one JSON line."""

import json

import torch
import torch._dynamo.utils as dynamo_utils
from torch._dynamo.callback import callback_handler

events = []
callback_handler.register_end_callback(lambda *a: events.append(a))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


block = _Block()
block.compile(backend="aot_eager", dynamic=True)
rows = []
for batch in (2, 5, 1):
    block(torch.randn(batch, 8, requires_grad=True)).sum().backward()
    rows.append({"batch": batch, "frames": dict(dynamo_utils.counters["frames"]), "callbacks": len(events)})
print(json.dumps({"torch": torch.__version__, "steps": rows}))

# The package's own path: VideoDiT's blocks under compile_blocks, one batch.
from lightning_adaptiveload.models.acceleration import compile_blocks  # noqa: E402
from lightning_adaptiveload.models.config import VideoDiTConfig  # noqa: E402
from lightning_adaptiveload.models.video_dit import VideoDiT  # noqa: E402

model = VideoDiT(VideoDiTConfig.preset("tiny"))
compile_blocks(model, backend="aot_eager")
before = (sum(dynamo_utils.counters["frames"].values()), len(events))
model(torch.randn(2, 16, 1, 8, 8), torch.rand(2), torch.randn(2, 7, 32)).float().pow(2).mean().backward()
after = (sum(dynamo_utils.counters["frames"].values()), len(events))
print(json.dumps({"video_dit_blocks": {"frames": [before[0], after[0]], "callbacks": [before[1], after[1]]}}))

"""Model benchmark: one decode step of B conversations at context C, this model over pages vs transformers.

    s2s bench model [--quick] [--device cuda] [--json PATH] [--plot PATH]

Both sides run the same weights (seeded), the same embedding sum and output heads; only the backbone and its
cache differ. Ours: `S2SModel.forward_paged` with K/V in pages (page size 16) through `paged_kernels.paged_attention`
(on CPU: the C++ decode kernel, which reads pages in place). Theirs: `transformers.LlamaModel` with
`attn_implementation="sdpa"` (its fastest on CPU) and its `DynamicCache`, under `torch.inference_mode()`. The
cache of C steps is filled with random K/V on both sides (a decode step's cost does not depend on the values), and
every timed step is one new frame for every conversation. Each side runs blocks of steps in turn (3 rounds), and
each side's p50 is its best block's median (see `compare`).
frames/s = B / step time: one frame of every codebook per conversation per step.

`--device cuda` runs both sides on the GPU in bf16 (transformers still with SDPA and DynamicCache, eagerly: its
static cache under torch.compile is not measured here), plus a third side: ours through `s2s/runner/cuda_graphs.py`, the
path the engine takes for its decode rounds (inputs copied into static buffers, one graph replay).
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm
from transformers import DynamicCache, LlamaModel

from bench.common import device_name, environment, parser, peak_rss_bytes, percentiles, print_table, save_outputs, timed
from s2s import ModelConfig, PagedBatch, S2SModel, placement
from s2s.runner.cuda_graphs import DecodeGraphs

PAGE_SIZE = 16


def _tokens(cfg: ModelConfig, batch: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (batch, cfg.step_width), generator=g).to(device)


def _param(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


def ours(model: S2SModel, batch: int, context: int, steps: int, graphs: bool = False):
    """A step function for this model over pages holding `context` random steps per conversation; with `graphs`,
    the engine's decode path on a GPU: inputs copied into static buffers, then one CUDA graph replay."""
    cfg = model.config
    pages_per_seq = -(-(context + steps) // PAGE_SIZE)
    num_pages = 1 + batch * pages_per_seq
    shape = (num_pages, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    like = {"dtype": _param(model).dtype, "device": _param(model).device}
    k = [torch.randn(shape, **like) for _ in range(cfg.num_hidden_layers)]
    v = [torch.randn(shape, **like) for _ in range(cfg.num_hidden_layers)]
    tables = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(batch)]

    def step(i: int) -> torch.Tensor:
        batch_ = PagedBatch.build([context + i] * batch, [1] * batch, tables, PAGE_SIZE, like["device"])
        return model.forward_paged(_tokens(cfg, batch, i, like["device"]), batch_, k, v).state

    if not graphs:
        return step
    replay = DecodeGraphs(model, k, v, PAGE_SIZE, max_batch=batch, max_pages=pages_per_seq)

    def graph_step(i: int) -> torch.Tensor:
        return replay.run(_tokens(cfg, batch, i, "cpu").numpy(), [context + i] * batch, tables)

    return graph_step


def theirs(model: S2SModel, llama: LlamaModel, batch: int, context: int):
    """A step function for transformers' LlamaModel over a DynamicCache holding `context` random steps."""
    cfg = model.config
    cache = DynamicCache(config=llama.config)
    like = {"dtype": _param(model).dtype, "device": _param(model).device}
    for layer in range(cfg.num_hidden_layers):
        kv = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
        cache.update(torch.randn(kv, **like), torch.randn(kv, **like), layer)

    def step(i: int) -> torch.Tensor:
        x = model.embed(_tokens(cfg, batch, i, like["device"]))[:, None]
        pos = torch.full((batch, 1), context + i, device=like["device"])
        hidden = llama(inputs_embeds=x, past_key_values=cache, position_ids=pos, use_cache=True).last_hidden_state
        return model.logits(hidden[:, -1])

    return step


@torch.inference_mode()
def compare(model: S2SModel, llama: LlamaModel, batch: int, context: int, steps: int, rounds: int = 3):
    """Time a block of `steps` steps of each side in turn, `rounds` times over (each block's first step not
    counted). Returns each side's blocks (ours, transformers, and ours on CUDA graphs where the model is on a GPU):
    a side's figure is its best block's median, because its speed drifts with the process's allocator state
    (transformers' per-step torch.cat page-faults in some states and runs 2x slower), and a comparison counts
    against the other side at its best."""
    n = rounds * (steps + 1)
    sides = [ours(model, batch, context, n), theirs(model, llama, batch, context)]
    if _param(model).is_cuda:
        sides.append(ours(model, batch, context, n, graphs=True))
    blocks = [[] for _ in sides]
    for r in range(rounds):
        for fn, side in zip(sides, blocks, strict=True):
            side.append([timed(_synced(fn), r * (steps + 1) + j)[0] for j in range(steps + 1)][1:])
    return blocks


def _synced(fn):
    """`fn` that returns only once the GPU has finished its work (a no-op on CPU)."""

    def run(i: int) -> torch.Tensor:
        out = fn(i)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return out

    return run


def best_block(blocks: list[list[float]]) -> dict[str, float]:
    """p50 of the fastest block, p95 over all blocks, in ms."""
    p50 = min(percentiles(b, 1000)["p50"] for b in blocks)
    return {"p50": p50, "p95": percentiles([t for b in blocks for t in b], 1000)["p95"]}


def plot(rows: list[dict], path, device: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        for context in sorted({r["context"] for r in rows}):
            pts = sorted((r["batch"], r["speedup"]) for r in rows if r["preset"] == preset and r["context"] == context)
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"context {context}")
        ax.axhline(1.0, color="k", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("conversations (batch)")
        ax.set_ylabel("frames/s, paged / transformers")
        ax.set_title(f"{preset} preset, one decode step, {device}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = parser("model", __doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both sides run there)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 (auto: bf16 on GPU, fp32 on CPU)")
    args = p.parse_args(argv)
    device, dtype = placement(args.device, args.dtype)
    if args.quick:
        presets, batches, contexts, steps = ["tiny", "small"], [1, 32], [256, 1024], 4
    else:
        presets, batches, contexts, steps = ["tiny", "small"], [1, 4, 16, 32], [256, 1024, 4096], 8
    rows = []
    grid = [(p, b, c) for p in presets for b in batches for c in contexts]
    models = {}
    for p in presets:
        model = S2SModel.from_seed(ModelConfig.preset(p), seed=0, dtype=dtype, device=device)
        llama = LlamaModel(model.config.to_llama_config()).eval()
        llama.config._attn_implementation = "sdpa"
        llama.load_state_dict(model.backbone.state_dict(), strict=False)
        llama.to(device=device, dtype=dtype)
        models[p] = (model, llama)
    for preset, batch, context in tqdm(grid, desc="model configs", file=sys.stderr):
        model, llama = models[preset]
        blocks = compare(model, llama, batch, context, steps)
        a, b = best_block(blocks[0]), best_block(blocks[1])
        graphed = {}
        if len(blocks) == 3:
            g = best_block(blocks[2])
            graphed = {
                "graph_step_ms_p50": g["p50"],
                "graph_step_ms_p95": g["p95"],
                "graph_frames_per_s": batch / g["p50"] * 1000,
                "graph_over_eager": a["p50"] / g["p50"],  # what the graphs buy (transformers has no graphs here)
            }
        rows.append(
            {
                "preset": preset,
                "params_backbone": sum(x.numel() for x in model.backbone.parameters()),
                "batch": batch,
                "context": context,
                "steps": steps,
                "page_size": PAGE_SIZE,
                "rounds": 3,
                "ours_step_ms_p50": a["p50"],
                "ours_step_ms_p95": a["p95"],
                "hf_step_ms_p50": b["p50"],
                "hf_step_ms_p95": b["p95"],
                "ours_frames_per_s": batch / a["p50"] * 1000,
                "hf_frames_per_s": batch / b["p50"] * 1000,
                "speedup": b["p50"] / a["p50"],
                **graphed,
                "peak_rss_bytes": peak_rss_bytes(),
            }
        )
    tables = print_table(
        "Decode step: paged S2S model vs transformers LlamaModel + DynamicCache (same weights)",
        rows,
        [
            ("preset", "preset"),
            ("batch", "batch"),
            ("context", "context"),
            ("ours_step_ms_p50", "paged step ms p50"),
            ("hf_step_ms_p50", "transformers step ms p50"),
            ("ours_frames_per_s", "paged frames/s"),
            ("hf_frames_per_s", "transformers frames/s"),
            ("speedup", "speedup"),
            *(
                [("graph_step_ms_p50", "paged + CUDA graph ms p50"), ("graph_over_eager", "graphs vs eager")]
                if graphed
                else []
            ),
        ],
    )
    env = {**environment(), "quick": args.quick, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    plot(rows, args.plot, device_name(args.device))
    save_outputs(args, [{**env, **r} for r in rows], tables)


if __name__ == "__main__":
    main()

"""Kyutai's own `moshi.server` (moshi 0.2.13) on a local Kyutai-layout folder, for `s2s bench moshi`: run in
.venv-moshi, not the main venv.

    .venv-moshi/bin/python bench/moshi_kyutai_server.py FOLDER --port P [--threads 1] [--dtype float32]

Runs Kyutai's module itself (`moshi/server.py`: its `main()`, `ServerState`, `handle_chat` and its one
`asyncio.Lock`, unchanged) with the command line `--config-path --moshi-weight --mimi-weight --tokenizer` of the
folder's files, `--device cpu`, `--static none` (no web page, which it would fetch from the Hub), no SSL. Three
things are patched around it, none of them in the serving path:
- `CheckpointInfo.from_hf_repo` gets the folder's Mimi config (`config.json`'s `mimi_config_name`) as
  `mimi_config_path`: the server has no flag for it and would fetch it from `--hf-repo` (Kyutai's full-size Mimi
  has none, so a small Mimi needs it);
- `torch.cuda.synchronize` does nothing where there is no CUDA: `ServerState.warmup` calls it unconditionally;
- `CheckpointInfo.get_moshi` loads the LM in `--dtype` (default float32, as `s2s serve` runs on a CPU): the server's
  only choices are bf16 (its default) and `--half`.
The server logs each input frame's time (`frame handled in X ms`: Mimi encode, `LMGen.step`, Mimi decode, Opus
and the send), which the benchmark reads from its output.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()

    import torch
    from moshi.models import loaders

    torch.set_num_threads(args.threads)
    folder = args.folder.resolve()
    raw = json.loads((folder / "config.json").read_text())
    mimi_config = folder / raw["mimi_config_name"] if raw.get("mimi_config_name") else None

    from_hf_repo = loaders.CheckpointInfo.from_hf_repo  # (a staticmethod)

    def local(*a, **kw):
        kw.setdefault("mimi_config_path", mimi_config)
        return from_hf_repo(*a, **kw)

    loaders.CheckpointInfo.from_hf_repo = staticmethod(local)

    get_moshi = loaders.CheckpointInfo.get_moshi
    dtype = getattr(torch, args.dtype)

    def in_dtype(self, *a, **kw):
        kw["dtype"] = dtype
        return get_moshi(self, *a, **kw)

    loaders.CheckpointInfo.get_moshi = in_dtype
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **kw: None

    sys.argv = ["moshi.server", "--host", args.host, "--port", str(args.port), "--device", "cpu", "--static", "none"]
    sys.argv += ["--config-path", str(folder / "config.json")]
    sys.argv += ["--moshi-weight", str(folder / raw.get("moshi_name", "model.safetensors"))]
    sys.argv += ["--mimi-weight", str(folder / raw.get("mimi_name", "mimi.safetensors"))]
    sys.argv += ["--tokenizer", str(folder / raw.get("tokenizer_name", "tokenizer.model"))]
    runpy.run_module("moshi.server", run_name="__main__")  # (the module runs its main() as it is imported)


if __name__ == "__main__":
    main()

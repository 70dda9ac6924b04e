"""`python -m engine generate --model DIR --prompt "..." [--max-new-tokens N]`: one-off generation."""

from __future__ import annotations

import argparse
import sys

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import RadixRayError
from engine.flags import add_struct_flags, given


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--model", default=None, help="HF checkpoint folder, GGUF file, or a model name (smollm2-135m-instruct, builtin, builtin-moe; default: builtin, random weights)")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="auto")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    engine_fields = add_struct_flags(g.add_argument_group("engine options (EngineConfig)"), EngineConfig,
                                     skip=("model_path", "device", "seed"))  # --seed: the request's
    args = ap.parse_args(argv)
    try:
        eng = Engine(EngineConfig.from_kwargs(model_path=args.model, device=args.device,
                                              **given(args, engine_fields)))
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        if args.stream and len(args.prompt) == 1:
            print(args.prompt[0], end="", flush=True)
            for delta in eng.stream(prompt=args.prompt[0], sampling_params=params):
                print(delta.text, end="", flush=True)
            print()
        else:
            for prompt, out in zip(args.prompt, eng.generate(prompt=args.prompt, sampling_params=params)):
                print(f"{prompt}{out.text}\n  [{out.prompt_tokens} prompt + {len(out.token_ids)} generated "
                      f"tokens, finish: {out.finish_reason}]")
        eng.check_memory()
    except RadixRayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

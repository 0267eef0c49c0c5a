"""``tetris generate``: one completion on the single-instance engine, printed to stdout.

Only the completion text goes to stdout (``--json`` prints one JSON object instead); errors
print ``error: ...`` to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a completion for one prompt",
        description="Generate a completion for one prompt with the single-instance engine.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="HF_DIR|GGUF",
                     help="local Hugging Face Llama checkpoint directory, .gguf file, or "
                          "pkg:<distribution>/<file> (docs/models.md)")
    src.add_argument("--config", metavar="DEPLOYMENT_TOML",
                     help="deployment file whose [model] to use (default: the embedded "
                          "tiny-cpu.toml)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-file", metavar="FILE", type=Path)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); it is cut from the output")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message with the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, finish reason)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=None,
                   help="where the engine runs (default: the config's model.device); auto: "
                        "CUDA when this process sees a GPU, else the CPU")
    p.add_argument("--plan", metavar="SPEC",
                   help="prefill on the SP pool with a forced chunk plan, e.g. "
                        "1500x1,2500x2,restx4 (TOKENSxSP; see docs/prefill.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        text = _read_prompt(args)
        params = _sampling_params(args)
        model, tokenizer, block_size = _load(args)
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt = tokenizer.encode(text, add_bos=True)
        if len(prompt) > 1 and prompt[0] == prompt[1] == tokenizer.bos_token_id:
            prompt = prompt[1:]  # the chat template wrote its own BOS
        if args.plan:  # CDSP prefill on the pool (tetris.actors.prefill.forced_run), engine decode
            from tetris.actors.prefill.forced_run import generate_with_plan

            out = generate_with_plan(args, prompt, params, tokenizer,
                                     lambda n: _engine(model, tokenizer, block_size, n))
        else:
            engine = _engine(model, tokenizer, block_size, len(prompt) + params.max_tokens)
            out = engine.generate([prompt], params)[0]
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": list(out.token_ids),
                          "prompt_tokens": len(out.prompt_token_ids),
                          "finish_reason": out.finish_reason}))
    else:
        sys.stdout.write(out.text + "\n")
    return 0


def _read_prompt(args) -> str:
    text = args.prompt_file.read_text() if args.prompt_file is not None else args.prompt
    if not text:
        raise ValueError("prompt is empty")
    return text


def _sampling_params(args):
    from tetris.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _load(args):
    from tetris.config import DeploymentConfig, load_deployment
    from tetris.model.loader import load_model, model_config_for_path

    if args.model is not None:
        deployment = DeploymentConfig(model=model_config_for_path(args.model))
    else:
        deployment = load_deployment(args.config)
    device = cli_device(args.device or deployment.model.device)
    model, tokenizer = load_model(deployment.model, device=device)
    return model, tokenizer, deployment.decode.block_size


def cli_device(requested: str) -> str:
    """"cuda" or "cpu" for the engine of this command (docs/gpu.md). A served actor's "auto" is
    CUDA only when Ray gave it a GPU; this process is not placed by Ray and owns the GPUs it
    sees, so "auto" is CUDA when one is visible. "cuda" without CUDA is a ``ConfigError``
    naming CUDA (tetris/device.py rule 1)."""
    import torch

    from tetris.device import resolve_device

    cuda = torch.cuda.is_available()
    return resolve_device(requested, cuda, list(range(torch.cuda.device_count())) if cuda else None)


def _engine(model, tokenizer, block_size: int, total_tokens: int):
    from tetris.engine.engine import LLMEngine

    # One request: size the cache to it (the engine itself rejects a prompt past the context).
    tokens = min(total_tokens, model.cfg.max_position_embeddings) + 1
    return LLMEngine(model, tokenizer, num_blocks=-(-tokens // block_size),
                     block_size=block_size, max_num_seqs=1)

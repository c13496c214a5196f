"""``python -m zeroflow.sample --run RUN_DIR --prompt "def "``: continue a prompt with the latest
checkpoint of a run, or ``--step N`` (restored onto one device, whatever mesh and ZeRO stage
trained it); the step used is named on stderr, and an unreadable latest checkpoint is refused
unless ``--step`` names the one to use.
``--chat`` sends the prompt as a user message through the tokenizer's chat template and
prints the reply, up to the end-of-text token. ``--interactive`` loads the model once and
answers each line read from stdin (a prompt, or with ``--chat`` a message) until end of input
or an empty line; the first answer compiles the sampler, the next ones reuse it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from zeroflow.cli.common import ArgumentParser, at_least, error_line, non_negative_float, run_cli
from zeroflow.cli.inputs import STEP_MAX, check_path, int_between, non_empty, seed_type

PROG = "zeroflow.sample"


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"python -m {PROG}", description=__doc__)
    p.add_argument(
        "--run",
        required=True,
        type=non_empty,
        help="run folder (holds config.yaml and checkpoints/)",
    )
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument(
        "--tokens",
        type=at_least(1),
        default=None,
        help="how many tokens to generate, at most the model's context (model.seq_len); "
        "default: 200, or the context when shorter",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy")
    p.add_argument(
        "--top-k", type=at_least(0), default=40, help="sample among the k likeliest (0 = all)"
    )
    p.add_argument("--seed", type=seed_type(), default=0, help="sampling seed (0 to 2**32 - 1)")
    p.add_argument(
        "--step",
        type=int_between(0, STEP_MAX, "the step counter is a 32-bit integer"),
        default=None,
        help="checkpoint step to sample from (default: the newest readable one; an unreadable "
        "newest checkpoint is reported and the one before it used)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="answer the prompt as a user message, with the tokenizer's chat template",
    )
    p.add_argument(
        "--interactive",
        action="store_true",
        help="keep the model loaded and answer each line of stdin (empty line or EOF ends)",
    )
    return p


def chat_prompt(tokenizer, message: str) -> list[int]:
    """Token ids of a one-message conversation rendered with the tokenizer's chat template,
    ending with the template's assistant header (add_generation_prompt)."""
    from zeroflow.data import load_chat_template
    from zeroflow.data.tokenizers import HFTokenizer

    template = load_chat_template(tokenizer.folder) if isinstance(tokenizer, HFTokenizer) else None
    if template is None:
        raise ValueError(
            f"--chat needs a tokenizer folder with a chat template; the run's "
            f"tokenizer is {tokenizer.name}"
        )
    text, _ = template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def until_end(tokenizer, tokens: list[int]) -> list[int]:
    """``tokens`` up to (not including) the first end-of-text token."""
    eos = getattr(tokenizer, "eos_id", None)
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def check_run_folder(run_dir: Path) -> None:
    """A ``--run`` that is no run folder is one line, before jax is imported."""
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} has no config.yaml: is it a zeroflow run folder?")


def load_params(run_dir: Path, step: int | None = None, *, before_reading=None):
    """(model config, tokenizer, fp32 params, step) of checkpoint ``step`` (default: the
    latest, which must be readable), on one device; a LoRA run's adapters folded into its
    base weights. Nothing in the run folder is changed. ``before_reading(model_cfg)``: checks
    of the caller's own inputs against the model, before the checkpoint is read."""
    from zeroflow.trainer.adapters import merged

    run, params, step = load_run_params(run_dir, step, before_reading=before_reading)
    return run.model_cfg, run.data.tokenizer, merged(run.lora, params), step


def load_run_params(
    run_dir: Path, step: int | None = None, *, with_data: bool = True, before_reading=None
):
    """(the run as ``build_run`` makes it, its fp32 params as trained, step) of checkpoint
    ``step`` on one device: a LoRA run's are ``{"base", "lora"}``. ``with_data=False``: the
    run has no data (nor tokenizer)."""
    import jax

    from zeroflow.config.io import load_config
    from zeroflow.trainer import build_run
    from zeroflow.trainer.checkpoints import RunCheckpoints, checkpoints_dir
    from zeroflow.trainer.sizes import check_fits

    check_run_folder(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    single = dataclasses.replace(
        cfg.parallel,
        data=1,
        model=1,
        zero_stage=0,
        offload="none",
        update_on="device",
        grad_accum=1,
    )
    cfg = dataclasses.replace(
        cfg, parallel=single, precision=dataclasses.replace(cfg.precision, params="fp32")
    )
    check_fits(cfg)
    run = build_run(cfg, devices=jax.devices()[:1], with_data=with_data)
    if before_reading is not None:
        before_reading(run.model_cfg)
    checkpoints = RunCheckpoints(
        checkpoints_dir(cfg, run_dir),
        cfg.checkpoint.keep,
        read_only=True,
        allow_unverified=cfg.checkpoint.allow_unverified,
    )
    try:
        state, meta = checkpoints.read(run.abstract_state(), step)
    finally:
        checkpoints.close()
    return run, state.params, meta["step"]


DEFAULT_TOKENS = 200


def _check_against_model(args, model_cfg) -> None:
    """The flags bounded by the run's model, checked before its weights are read: --tokens by
    its context (the longest window it was trained on), --top-k by its vocabulary."""
    context = model_cfg.seq_len
    if args.tokens is None:
        args.tokens = min(DEFAULT_TOKENS, context)
    if args.tokens > context:
        raise ValueError(
            f"--tokens {args.tokens} is more than the model's context of {context} tokens "
            "(model.seq_len of the run: the longest window it was trained on); give at most "
            f"{context}"
        )
    if args.top_k > model_cfg.vocab_size:
        raise ValueError(
            f"--top-k {args.top_k} is more than the model's vocabulary of "
            f"{model_cfg.vocab_size} tokens; give at most {model_cfg.vocab_size} (0 = all)"
        )


def main_args(args) -> int:
    check_run_folder(Path(args.run))
    import jax

    from zeroflow.models import generate

    check_path("--run", Path(args.run))
    if not args.interactive and not args.prompt:
        raise ValueError("--prompt must not be empty: give the text to continue")
    model_cfg, tokenizer, params, step = load_params(
        Path(args.run), args.step, before_reading=lambda cfg: _check_against_model(args, cfg)
    )
    print(f"[step {step}]", file=sys.stderr)

    def answer(text: str, seed: int) -> str:
        prompt = chat_prompt(tokenizer, text) if args.chat else tokenizer.encode(text)
        if not prompt:
            raise ValueError("the prompt encodes to no tokens")
        new = generate(
            params,
            model_cfg,
            prompt,
            max_new_tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            rng=jax.random.key(seed),
        )
        return (
            tokenizer.decode(until_end(tokenizer, new))
            if args.chat
            else text + tokenizer.decode(new)
        )

    if not args.interactive:
        print(answer(args.prompt, args.seed))
        return 0
    return prompt_loop(answer, args.seed)


def prompt_loop(answer, seed: int, lines=None) -> int:
    """Answer each line of ``lines`` (default: stdin) until an empty line or end of input; the
    n-th answer samples with seed ``seed + n``. A prompt that cannot be answered (one that
    encodes to no tokens) is reported on stderr and the loop goes on."""
    lines = sys.stdin if lines is None else lines
    interactive = sys.stdin.isatty() if lines is sys.stdin else False
    for n, line in enumerate(_prompts(lines, interactive)):
        try:
            print(answer(line, seed + n), flush=True)
        except ValueError as e:
            print(error_line(PROG, str(e)), file=sys.stderr, flush=True)
    return 0


def _prompts(lines, interactive: bool):
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line or not line.rstrip("\n"):
            return
        # A literal backslash-n in a typed prompt stands for a newline ("def f():\n    ").
        yield line.rstrip("\n").replace("\\n", "\n")


def main(argv=None) -> int:
    return run_cli(PROG, main_args, parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

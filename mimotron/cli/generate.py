"""``mimotron generate SOURCE --prompt TEXT [--image FILE] [--audio FILE] ...``.

Loads a trained model on this one process (an accelerator when the runtime has one,
else the CPU; ``MIMOTRON_DEVICE=cpu`` forces the CPU) from a run directory, a checkpoint
or an export folder (``--format mimotron`` or ``hf``), and prints the reply to stdout;
one line on stderr says what was loaded, how long the prompt was and why the reply
ended. See :mod:`mimotron.generate`.

Exit code 0 on success; 2 for a bad argument or input (a missing file, a source that is
not a trained model, weights without a language model, a run not trained on LLaVA
data); 1 for a damaged checkpoint or any other failure. Every failure is one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mimotron.outputs import EXIT_FAILED, EXIT_USAGE, report_error


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the ``mimotron`` command's subparsers (imports no torch:
    every command builds this parser)."""
    s = sub.add_parser("generate", help="answer a prompt (with an image / audio clip) from a "
                                        "trained run, checkpoint or export folder")
    s.add_argument("source", help="run directory (holding checkpoints/), checkpoint (a root "
                                  "holding 'latest' or an iter_NNNNNNN dir) or export folder "
                                  "(mimotron export --format mimotron or hf; an hf-llava "
                                  "folder is for transformers)")
    s.add_argument("--prompt", required=True, help="the user's text; <image>/<audio> are put "
                                                   "before it unless it holds them")
    s.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image file; repeat it for several (up to the run's "
                        "data.max_images_per_sample)")
    s.add_argument("--video", action="append", default=[], metavar="PATH",
                   help="a video file or folder of frames (a Qwen2.5-VL / Qwen3-VL model); "
                        "repeat it for several")
    s.add_argument("--audio", action="append", default=[], metavar="FILE",
                   help="a WAV file (at most one)")
    s.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="the most tokens to generate (default 64); the reply also ends "
                        "where it and the prompt fill the language model's context")
    s.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default) = greedy; > 0 samples from softmax(logits / T)")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens holding this probability mass "
                        "(default 1.0 = all)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")


def run_generate(args: argparse.Namespace) -> int:
    """Run ``mimotron generate`` with parsed ``args``; the process exit code."""
    from mimotron.checkpoint.files import CheckpointError
    from mimotron.generate.decode import STOP_CONTEXT, Generator, Sampling
    from mimotron.generate.prompt import check_files

    try:
        sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        if args.max_new_tokens is not None:
            sampling = dataclasses.replace(sampling, max_new_tokens=args.max_new_tokens)
        sampling.check()  # these two before the model is read
        check_files({"image": args.image, "audio": args.audio})
        missing = [v for v in args.video if not Path(v).exists()]
        if missing:
            raise ValueError(f"--video {missing[0]!r} not found (a video file or a folder "
                             "of frames)")
        generator = Generator.from_path(args.source)
        reply = generator.generate(args.prompt, args.image, args.audio, sampling, args.video)
    except ValueError as exc:
        return report_error("generate", exc, EXIT_USAGE, show_type=False)
    except CheckpointError as exc:
        return report_error("generate", exc, EXIT_FAILED, show_type=False)
    except Exception as exc:  # noqa: BLE001 - OSError, ...: one line
        return report_error("generate", exc, EXIT_FAILED)
    loaded = generator.loaded
    print(reply.text, flush=True)
    num = len(reply.token_ids)
    why = reply.stop
    if why == STOP_CONTEXT:
        why += f" (the language model's context length, {generator.max_len} tokens)"
    print(f"mimotron generate: {loaded.source.describe()} on {loaded.device}; prompt "
          f"{reply.prompt_tokens} tokens, reply {num} token{'' if num == 1 else 's'}, stopped "
          f"at {why}", file=sys.stderr, flush=True)
    return 0

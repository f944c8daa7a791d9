# Perplexity of one checkpoint in several precisions and quantization modes, on a fixed slice of
# English text that every Python install carries: the accuracy table in the README.
#
#   python -m scripts.perplexity --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \
#       --modes float32,bfloat16,int8,int4.g32,int4.g128,int4-gptq.g32,int4-gptq.g128,fp8 \
#       --out results.json
#
# Run it from the repository root with `python -m`: that puts the root on sys.path, so the
# benchmark uses generate.py, quantize.py and GPTQ.py as they are, with no path edits.
#
# Text: the Python language reference that ships in the standard library (pydoc_data.topics,
# topics in name order), or --text_file. The first --tokens tokens are cut into non-overlapping
# windows of --window tokens; each window starts from an empty cache and every token but its
# first is scored. GPTQ calibrates on the tokens after that slice, so it never sees them.
# Quantized modes are made in-process with quantize.quantize_checkpoint, written to a temporary
# folder and loaded back through generate.load_model, the same path a user's checkpoint takes.
import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import GPTQ
    import quantize
    from generate import PRECISIONS, CheckpointError, load_model, log
    from tokenizer import get_tokenizer
except ModuleNotFoundError as e:  # started as a file: the repository root is not on sys.path
    raise SystemExit(
        f"error: {e.name} not found; run from the repository root: python -m scripts.perplexity"
    ) from e


def parse_mode(mode: str) -> tuple[str, int | None]:
    # "int4-gptq.g32" -> ("int4-gptq", 32); "int8" -> ("int8", None)
    name, _, group = mode.partition(".g")
    if name in PRECISIONS or name in ("int8", "fp8"):
        if group:
            raise ValueError(f"mode {mode!r} takes no group size")
        return name, None
    if name in ("int4", "int4-gptq") and group.isdigit():
        return name, int(group)
    raise ValueError(
        f"unknown mode {mode!r} (float32, bfloat16, float16, int8, fp8, int4.gN, int4-gptq.gN)"
    )


def text_tokens(tok, text_file: Path | None) -> tuple[torch.Tensor, str]:
    if text_file is None:
        text = GPTQ.pydoc_text()
        source = f"pydoc_data.topics of Python {platform.python_version()}"
    else:
        text, source = text_file.read_text(encoding="utf-8"), str(text_file)
    return torch.tensor(tok.encode(text, bos=False)), source


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, progress: bool = True) -> float:
    # windows [n, W] token ids -> exp(mean negative log-likelihood of every token after the
    # first of each window)
    from tqdm import tqdm

    device = model.tok_embeddings.weight.device
    n, width = windows.shape
    model.setup_caches(1, width)
    input_pos = torch.arange(width, device=device)
    nll = 0.0
    for row in tqdm(windows, desc="windows", file=sys.stderr, disable=not progress, leave=False):
        x = row[None].to(device)  # [1, W]
        logits = model(x, input_pos)[0, :-1].float()  # [W-1, vocab]
        nll += float(F.cross_entropy(logits, x[0, 1:], reduction="sum"))
    return math.exp(nll / (n * (width - 1)))


def evaluate_mode(
    mode, checkpoint, windows, calibration, precision, device, skip_output, gptq_kwargs, tmp
):
    # -> (perplexity, size of the weights file in MB)
    name, groupsize = parse_mode(mode)
    if name in PRECISIONS:
        model = load_model(checkpoint, device, PRECISIONS[name])
        return perplexity(model, windows), checkpoint.stat().st_size / 1e6
    state = quantize.quantize_checkpoint(
        checkpoint,
        name,
        groupsize,
        skip_output=skip_output,
        device=device,
        calibration=calibration if name == "int4-gptq" else None,
        **(gptq_kwargs if name == "int4-gptq" else {}),
    )
    path = tmp / quantize.default_output_path(checkpoint, name, groupsize or 0).name
    quantize.save_atomic(state, path)
    del state
    model = load_model(path, device, PRECISIONS[precision])
    try:
        return perplexity(model, windows), path.stat().st_size / 1e6
    finally:
        path.unlink()


def markdown_table(results: dict) -> str:
    rows = [
        "| mode | perplexity | vs bfloat16 | file MB | seconds |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    base = results.get("bfloat16", {}).get("perplexity")
    for mode, r in results.items():
        if "error" in r:
            rows.append(f"| {mode} | n/a: {r['error']} | | | |")
            continue
        rel = f"{100 * (r['perplexity'] / base - 1):+.2f}%" if base else ""
        rows.append(
            f"| {mode} | {r['perplexity']:.3f} | {rel} | {r['file_mb']:.0f} | {r['seconds']:.0f} |"
        )
    return "\n".join(rows)


def write_json(path: Path, data: dict):
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def main(
    checkpoint_dir: Path,
    modes: str,
    text_file: Path | None,
    tokens: int,
    window: int,
    precision: str,
    calibration_limit: int,
    calibration_seq_length: int,
    percdamp: float,
    blocksize: int,
    act_order: bool,
    skip_output: bool,
    device: str,
    out: Path | None,
):
    checkpoint = checkpoint_dir / "model.pth"
    try:
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        for mode in mode_list:
            parse_mode(mode)
        if text_file is not None and not text_file.is_file():
            raise ValueError(f"text file {text_file} does not exist")
        if not checkpoint.is_file():
            raise ValueError(f"no model.pth in {checkpoint_dir}")
        tok = get_tokenizer(checkpoint_dir)
    except (ValueError, CheckpointError) as e:
        sys.exit(f"error: {e}")
    ids, source = text_tokens(tok, text_file)
    n_windows = tokens // window
    need = n_windows * window + calibration_limit * calibration_seq_length
    if n_windows == 0 or len(ids) < n_windows * window:
        sys.exit(f"error: {source} has {len(ids)} tokens; --tokens {tokens} needs more")
    windows = ids[: n_windows * window].view(n_windows, window)
    calibration = None
    if any(m.startswith("int4-gptq") for m in mode_list):
        rest = ids[n_windows * window :]
        n_calib = min(calibration_limit, len(rest) // calibration_seq_length)
        if n_calib == 0:
            sys.exit(f"error: {source} has no tokens left for calibration ({len(ids)} < {need})")
        calibration = rest[: n_calib * calibration_seq_length].view(n_calib, -1)
    report = {
        "checkpoint": str(checkpoint),
        "text": source,
        "tokens_scored": n_windows * (window - 1),
        "windows": f"{n_windows} x {window}",
        "device": device,
        "precision_of_quantized_modes": precision,
        "skip_output": skip_output,
        "gptq": dict(
            calibration=f"{0 if calibration is None else calibration.shape[0]} x "
            f"{calibration_seq_length} tokens after the evaluated slice",
            percdamp=percdamp,
            blocksize=blocksize,
            act_order=act_order,
        ),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "results": {},
    }
    log(f"{report['windows']} tokens of {source}")
    gptq_kwargs = dict(percdamp=percdamp, blocksize=blocksize, act_order=act_order)
    with tempfile.TemporaryDirectory(dir=checkpoint_dir) as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text((checkpoint_dir / "config.json").read_text())
        for mode in mode_list:
            t0 = time.perf_counter()
            try:
                ppl, size = evaluate_mode(
                    mode,
                    checkpoint,
                    windows,
                    calibration,
                    precision,
                    device,
                    skip_output,
                    gptq_kwargs,
                    tmp,
                )
                result = dict(perplexity=ppl, file_mb=size, seconds=time.perf_counter() - t0)
                log(f"{mode}: perplexity {ppl:.4f} ({result['seconds']:.0f} s)")
            except (quantize.QuantizeError, GPTQ.GPTQError) as e:
                result = dict(error=str(e))
                log(f"{mode}: {e}")
            report["results"][mode] = result
            if out is not None:
                write_json(out, report)
    print(markdown_table(report["results"]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Perplexity of a checkpoint in several precisions and quantization modes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint_dir", type=Path, required=True, help="folder with model.pth")
    p.add_argument(
        "--modes",
        default="float32,bfloat16,int8,int4.g32,int4.g128,int4-gptq.g32,int4-gptq.g128,fp8",
        help="comma-separated: float32, bfloat16, float16, int8, fp8, int4.gN, int4-gptq.gN",
    )
    p.add_argument(
        "--text_file", type=Path, default=None, help="English text (default: pydoc_data.topics)"
    )
    p.add_argument("--tokens", type=int, default=32768, help="tokens evaluated (whole windows)")
    p.add_argument("--window", type=int, default=1024, help="tokens per window")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="float32",
        help="activation dtype of the quantized modes",
    )
    p.add_argument("--calibration_limit", type=int, default=128, help="GPTQ sequences")
    p.add_argument("--calibration_seq_length", type=int, default=512, help="GPTQ sequence length")
    p.add_argument("--percdamp", type=float, default=0.01, help="GPTQ damping")
    p.add_argument("--blocksize", type=int, default=128, help="GPTQ block size")
    p.add_argument(
        "--act_order", action=argparse.BooleanOptionalAction, default=False, help="GPTQ act-order"
    )
    p.add_argument(
        "--skip_output",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the output head in float in the quantized modes",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))

# Accuracy of a fastgen checkpoint through EleutherAI's lm-evaluation-harness (lm_eval 0.4.x).
#
#   python eval.py --tasks hellaswag --limit 100          # a built-in task whose data is cached
#   python eval.py --include_path tests/eval_tasks --tasks fastgen_mc fastgen_ppl fastgen_gen
#   python eval.py --checkpoint_path checkpoints/meta-llama/Llama-3.1-8B/model.pth \
#       --tasks mmlu --num_fewshot 5 --batch_size 16 --compile --output mmlu.json
#   python eval.py --bench_batching 1000 --batch_size 32  # loglikelihood speed-up over batch 1
#
# Data comes from the Hugging Face cache only: main() sets HF_DATASETS_OFFLINE=1 and
# HF_HUB_OFFLINE=1 unless you set them yourself (set both to 0 to download), so a task whose data
# is missing fails at once with one line instead of after a stall of retries. Local tasks (task
# YAMLs in an --include_path folder, data in local files) need no network at all.
#
# How requests run (FastgenLM below):
# - loglikelihood: longest first, --batch_size right-padded rows per full forward; requests that
#   feed the model the same tokens (multiple choice with one-token answers) share one row.
# - loglikelihood_rolling: documents cut into windows of --max_seq_length tokens exactly as
#   lm_eval's hf model cuts them, then scored as loglikelihood requests.
# - generate_until: generate.generate() on batches of --batch_size prompts with the same
#   generation kwargs; a row ends at its task's stop strings or the tokenizer's stop tokens.
#
# The results table goes to stdout; progress, timings and the benchmark go to stderr.
import argparse
import difflib
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor
from tqdm import tqdm

import tp
from generate import (
    DEFAULT_CHECKPOINT,
    PRECISIONS,
    CheckpointError,
    UserError,
    compile_steps,
    generate,
    left_pad,
    load_for_rank,
    log,
    pick_device,
    sync,
)
from model import ConfigError, Transformer
from tokenizer import StreamDecoder, Tokenizer, TokenizerError, get_tokenizer

DEFAULT_MAX_SEQ_LENGTH = 2048  # when the model's context is longer; lm_eval's hf default too


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def forward_logits(model: Transformer, x: Tensor) -> Tensor:
    # x [B, T] written to cache slots 0..T-1 -> logits [B, T, vocab]. Stale cache slots beyond T
    # are masked by causality, so the cache needs no clearing between batches.
    return model(x, torch.arange(x.shape[1], device=x.device))


class AllRowsStopped(Exception):
    """Raised from generate()'s on_token callback to end the loop once every row is done."""


# ---------------------------------------------------------------------------------------------
# The lm_eval model
# ---------------------------------------------------------------------------------------------


class FastgenLM(TemplateLM):
    """A loaded fastgen model as lm_eval sees it. TemplateLM turns (context, continuation) text
    into token ids; scoring and generation run here on our model and decode loop."""

    def __init__(
        self,
        model: Transformer,
        tok: Tokenizer,
        device: torch.device | str,
        max_seq_length: int,
        batch_size: int = 1,
        compile: bool = False,
        max_gen_toks: int = 256,
    ):
        super().__init__()
        if tok.bos_id is None and tok.eos_id is None:
            raise UserError("the tokenizer has neither bos nor eos: nothing to condition on")
        self.model = model
        self.tok = tok
        self._device = torch.device(device)
        self.max_length = max_seq_length
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks  # when a task sets none (lm_eval's convention)
        self.bos_text = tok.decode([tok.bos_id]) if tok.bos_id is not None else None
        # One cache for everything: scoring writes slots 0..T-1 of each row, generation needs
        # prompt + new tokens <= max_seq_length. Tensor parallelism must be applied before this.
        model.setup_caches(batch_size, max_seq_length)
        self.forward = forward_logits
        if compile:
            self.forward = torch.compile(forward_logits, dynamic=True, fullgraph=True)
        self.steps = compile_steps(compile, compile_prefill=compile)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id if self.tok.eos_id is not None else self.tok.bos_id

    @property
    def prefix_token_id(self) -> int:
        # What an empty context and the first rolling window condition on: bos, else eos, as in
        # lm_eval's hf model.
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        # None: the model's own bos rule, but no second bos on text that starts with one.
        # Special-token strings in the text become their ids, as transformers' encode does.
        bos = self.tok.add_bos if add_special_tokens is None else add_special_tokens
        if self.tok.bos_id is None:
            bos = False
        elif add_special_tokens is None and string.startswith(self.bos_text):
            bos = False
        return self.tok.encode(string, bos=bos, allow_special=True)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special=True)

    def get_model_info(self) -> dict:
        # lm_eval merges this into the results' "config".
        return {
            "model_num_parameters": sum(
                {p.data_ptr(): p.numel() for p in self.model.parameters()}.values()
            ),  # a tied output head counted once
            "model_dtype": str(self.model.tok_embeddings.weight.dtype),
            "max_seq_length": self.max_length,
        }

    # --- loglikelihood -------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        # requests: [(key or None, context ids, continuation ids)] -> [(log p(continuation), is
        # the continuation the greedy choice)], in the order given.
        for _, _, cont in requests:
            if len(cont) > self.max_length:
                raise UserError(
                    f"a continuation of {len(cont)} tokens does not fit --max_seq_length "
                    f"{self.max_length}"
                )
        # Longest first (the Collator sorts and restores the order). Requests whose context plus
        # continuation-but-its-last-token are the same tokens feed the model the same row, so the
        # Collator hands us one of them and get_cache() gives the row's logits to all.
        collator = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1]) - len(r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[1] + r[2][:-1],
        )
        results = []
        bar = tqdm(
            total=len(requests), desc="loglikelihood", disable=disable_tqdm or not is_rank0()
        )
        for batch in collator.get_batched(n=self.batch_size):
            # The model reads (context + continuation)[:-1], cut from the left to max_length; the
            # logit at position t predicts token t+1, so the last len(cont) logits of a row score
            # its continuation.
            rows = [(ctx + cont)[-(self.max_length + 1) : -1] for _, ctx, cont in batch]
            width = max(len(r) for r in rows)
            x = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
            logits = self.forward(self.model, x)  # [B, width, vocab]; right padding is ignored
            scores = []
            for (key, ctx, cont), row, row_logits in zip(batch, rows, logits):
                shared = collator.get_cache(
                    req_str=key, cxt_toks=ctx, cont_toks=cont, logits=row_logits[None]
                )
                for _, cont_i, lg in shared:
                    n = len(cont_i)
                    logprobs = F.log_softmax(lg[0, len(row) - n : len(row)].float(), dim=-1)
                    target = torch.tensor(cont_i, device=self.device)  # [n]
                    picked = logprobs.gather(-1, target[:, None]).sum()
                    greedy = (logprobs.argmax(dim=-1) == target).all().float()
                    scores.append(torch.stack([picked, greedy]))
            for logprob, greedy in torch.stack(scores).tolist():  # one host sync per batch
                results.append((logprob, bool(greedy)))
            bar.update(len(scores))
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # Perplexity: each document's tokens in windows of max_length (lm_eval's own windowing,
        # so numbers match its hf model); every token is predicted once, with the most context
        # a window allows.
        windows, owners = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, cont in map(make_disjoint_window, pairs):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        return totals

    # --- generation ----------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        # Batches of up to batch_size prompts sharing their generation kwargs, longest first.
        collator = Collator(
            [r.args for r in requests],
            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
            group_by="gen_kwargs",
            group_fn=lambda a: a[1],
        )
        eos_text = self.tok.decode([self.eot_token_id])
        out = []
        bar = tqdm(total=len(requests), desc="generate", disable=disable_tqdm or not is_rank0())
        for batch in collator.get_batched(n=self.batch_size):
            kwargs = normalize_gen_kwargs(batch[0][1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs["max_gen_toks"]
            room = self.max_length - max_new
            if room < 1:
                raise UserError(
                    f"max_gen_toks {max_new} leaves no room for a prompt in --max_seq_length "
                    f"{self.max_length}"
                )
            # Prompts are cut from the left to leave room for max_new tokens, as in lm_eval.
            prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c, _ in batch]
            sampling = dict(
                temperature=float(kwargs["temperature"]) if kwargs["do_sample"] else 0.0,
                top_k=kwargs.get("top_k"),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            out += self.generate_rows(prompts, max_new, until, sampling)
            bar.update(len(batch))
        bar.close()
        return collator.get_original(out)

    def generate_rows(
        self, prompts: list[list[int]], max_new_tokens: int, until: list[str], sampling: dict
    ) -> list[str]:
        # generate() stops rows at stop tokens only; on_token watches each row's text for the
        # stop strings too and ends the loop once every row has stopped one way or the other.
        x, pad = left_pad(prompts, self.device)
        stop_ids = self.tok.stop_ids
        rows = [[] for _ in prompts]
        texts = [""] * len(prompts)
        streams = [StreamDecoder(self.tok) for _ in prompts]
        done = [False] * len(prompts)
        longest_stop = max((len(s) for s in until), default=0)

        def watch(step: list[int]):
            for i, t in enumerate(step):
                if done[i]:
                    continue
                rows[i].append(t)
                piece = streams[i].push(t)
                texts[i] += piece
                tail = texts[i][-(len(piece) + longest_stop) :]  # where a new match can end
                done[i] = t in stop_ids or any(s and s in tail for s in until)
            if all(done):
                raise AllRowsStopped

        try:
            generate(
                self.model,
                x,
                max_new_tokens,
                pad=pad,
                stop_ids=stop_ids,
                on_token=watch,
                **sampling,
                **self.steps,
            )
        except AllRowsStopped:
            pass
        # Decoded without special tokens, cut at the first stop string: lm_eval's hf model does
        # the same, so the texts compare equal.
        return [
            postprocess_generated_text(self.tok.decode(r, skip_special=True), until, None)
            for r in rows
        ]


# ---------------------------------------------------------------------------------------------
# Batching benchmark
# ---------------------------------------------------------------------------------------------


def synthetic_requests(n: int, vocab_size: int, max_length: int, seed: int = 0) -> list[tuple]:
    # Loglikelihood requests shaped like a multiple-choice task's (hellaswag: ~100 context
    # tokens, ~20 continuation tokens), random tokens, none sharing a row.
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        n_cont = rng.randint(1, min(32, max_length // 2))
        n_ctx = rng.randint(1, min(256, max_length - n_cont))
        ctx = [rng.randrange(vocab_size) for _ in range(n_ctx)]
        cont = [rng.randrange(vocab_size) for _ in range(n_cont)]
        requests.append((None, ctx, cont))
    return requests


def bench_loglikelihood_batching(lm: FastgenLM, n_requests: int = 1000) -> dict:
    """Time n_requests synthetic loglikelihood requests at batch size 1 and at lm.batch_size."""
    requests = synthetic_requests(n_requests, lm.model.config.vocab_size, lm.max_length)
    batch_size = lm.batch_size
    seconds, scores = {}, {}
    try:
        for bs in sorted({1, batch_size}):
            lm.batch_size = bs
            lm._loglikelihood_tokens(requests[: 2 * bs + 1], disable_tqdm=True)  # compile, warm up
            sync(lm.device)
            t0 = time.perf_counter()
            scores[bs] = lm._loglikelihood_tokens(requests, disable_tqdm=not is_rank0())
            sync(lm.device)
            seconds[bs] = time.perf_counter() - t0
    finally:
        lm.batch_size = batch_size
    diff = max(abs(a[0] - b[0]) for a, b in zip(scores[1], scores[batch_size]))
    greedy_same = sum(a[1] == b[1] for a, b in zip(scores[1], scores[batch_size]))
    n_tokens = sum(len(ctx) + len(cont) - 1 for _, ctx, cont in requests)
    return {
        "requests": n_requests,
        "tokens": n_tokens,
        "batch_size": batch_size,
        "seconds_batch_size_1": seconds[1],
        "seconds": seconds[batch_size],
        "speedup": seconds[1] / seconds[batch_size],
        "requests_per_s_batch_size_1": n_requests / seconds[1],
        "requests_per_s": n_requests / seconds[batch_size],
        "max_abs_logprob_diff": diff,
        "is_greedy_agree": greedy_same / n_requests,
    }


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


def first_line(e: Exception) -> str:
    text = str(e).strip().strip("'\"")
    return f"{type(e).__name__}: {(text.splitlines() or [''])[0]}"


def builtin_task_folder(name: str) -> Path | None:
    # The folder of the one built-in YAML that says `task: <name>`, found by a text scan (~1 s)
    # instead of lm_eval's index of all ~14,000 built-in YAMLs (~15 s). None for groups, tags
    # and anything ambiguous: those need the whole index. A task is complete in its folder
    # (its includes and !function files are found by path).
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    pattern = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
    hits = [p for p in root.rglob("*.yaml") if pattern.search(p.read_text(errors="replace"))]
    return hits[0].parent if len(hits) == 1 else None


def load_tasks(names: list[str], include_path: list[Path] | None):
    # -> (TaskManager, [Task or Group]); datasets load here, before the model, so a task that
    # cannot be loaded fails in seconds. Imported here: lm_eval.tasks imports datasets and
    # huggingface_hub, which read the offline variables main() sets.
    from lm_eval.tasks import TaskManager

    for folder in include_path or []:
        if not folder.is_dir():
            raise UserError(f"--include_path {folder} is not a folder")
    paths = [str(p) for p in include_path or []]
    local = TaskManager(include_path=paths, include_defaults=False) if paths else None
    builtin = [n for n in names if local is None or n not in local.all_tasks]
    folders = [builtin_task_folder(n) for n in builtin]
    manager = None
    if all(folders):
        # Built-in folders first: later paths override earlier ones, so --include_path wins.
        manager = local
        if folders:
            folders = list(dict.fromkeys(str(f) for f in folders))  # arc_easy, arc_challenge
            manager = TaskManager(include_path=folders + paths, include_defaults=False)
        if not all(name in manager.all_tasks for name in names):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=paths or None)
    loaded = []
    for name in names:
        if name not in manager.all_tasks and not Path(name).is_file():
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise UserError(f"unknown task {name!r}{hint}")
        try:
            found = manager.load([name])
        except Exception as e:  # noqa: BLE001 - datasets and the hub raise many unrelated types
            message = f"task {name} could not be loaded (no network?): {first_line(e)}"
            if os.environ.get("HF_DATASETS_OFFLINE") == "1":
                message += "; to download, set HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0"
            raise UserError(message) from e
        if name in found["groups"]:
            loaded.append(found["groups"][name])
        elif name in found["tasks"]:
            loaded.append(found["tasks"][name])
        else:  # a tag or a YAML path: its tasks
            loaded += found["tasks"].values()
    return manager, loaded


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def main(
    checkpoint_path: Path | None,
    tasks: list[str],
    include_path: list[Path] | None,
    limit: float | None,
    num_fewshot: int | None,
    batch_size: int,
    max_seq_length: int | None,
    compile: bool,
    device: str | None,
    precision: str | None,
    output: Path | None,
    log_samples: bool,
    bench_batching: int | None,
):
    # Before lm_eval.tasks imports datasets and huggingface_hub, which read them once.
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(name, "1")
    try:
        if batch_size < 1:
            raise UserError(f"--batch_size must be >= 1, got {batch_size}")
        if limit is not None and limit <= 0:
            raise UserError(f"--limit must be > 0, got {limit}")
        if bench_batching is not None and bench_batching < 1:
            raise UserError(f"--bench_batching must be >= 1, got {bench_batching}")
        dev = pick_device(device)
        tp.maybe_init_distributed(dev)  # torchrun: one rank per GPU
        if checkpoint_path is None:
            checkpoint_path = DEFAULT_CHECKPOINT
            if not checkpoint_path.is_file():
                raise UserError(
                    f"the default model is not prepared ({checkpoint_path} is missing): "
                    "run `bash scripts/prepare.sh` or pass --checkpoint_path"
                )
        dtype = PRECISIONS[precision or ("bfloat16" if dev.type == "cuda" else "float32")]
        names = [n for arg in tasks for n in arg.split(",") if n]
        if not names and bench_batching is None:
            raise UserError("--tasks names no task")
        if bench_batching is None:
            manager, task_objs = load_tasks(names, include_path)

        t0 = time.perf_counter()
        tok = get_tokenizer(checkpoint_path.parent)
        model = load_for_rank(checkpoint_path, dev, dtype)
        log(f"loaded {checkpoint_path} in {time.perf_counter() - t0:.2f} s")
        block_size = model.config.block_size
        max_seq_len = max_seq_length or min(block_size, DEFAULT_MAX_SEQ_LENGTH)
        if not 1 < max_seq_len <= block_size:
            raise UserError(f"--max_seq_length must be in [2, {block_size}], got {max_seq_len}")
        lm = FastgenLM(model, tok, dev, max_seq_len, batch_size, compile)

        if bench_batching is not None:
            report = bench_loglikelihood_batching(lm, bench_batching)
            log(
                f"{report['requests']} loglikelihood requests ({report['tokens']} tokens): "
                f"{report['seconds_batch_size_1']:.2f} s at batch size 1, "
                f"{report['seconds']:.2f} s at batch size {batch_size}: {report['speedup']:.2f}x; "
                f"max |logprob diff| {report['max_abs_logprob_diff']:.2e}"
            )
            results = {"bench_batching": report}
        else:
            results = run_tasks(lm, manager, task_objs, limit, num_fewshot, log_samples)
            if results is None:  # not the rank that reports (torchrun)
                return
            results["config"]["checkpoint_path"] = str(checkpoint_path)
            results["config"]["compile"] = compile
    except (UserError, CheckpointError, ConfigError, TokenizerError, tp.TPError) as e:
        sys.exit(f"error: {e}")
    if output is not None and is_rank0():
        from lm_eval.utils import handle_non_serializable

        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
        log(f"results written to {output}")


def run_tasks(lm, manager, task_objs, limit, num_fewshot, log_samples) -> dict | None:
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    if limit is not None and limit >= 1:
        limit = int(limit)  # lm_eval reads a float below 1 as a fraction of each task
    t0 = time.perf_counter()
    results = simple_evaluate(
        model=lm,
        tasks=task_objs,
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=lm.batch_size,
        device=str(lm.device),
        log_samples=log_samples,
    )
    if results is None:
        return None
    log(f"evaluated in {time.perf_counter() - t0:.2f} s")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Evaluate a fastgen checkpoint with lm-evaluation-harness.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint_path",
        type=Path,
        default=None,
        help=f"model.pth to load (default: {DEFAULT_CHECKPOINT})",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=["hellaswag"],
        help="task, group or tag names, space- or comma-separated",
    )
    p.add_argument(
        "--include_path",
        nargs="+",
        type=Path,
        default=None,
        help="folders of local task YAMLs",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=None,
        help="documents per task (a number below 1 is a fraction); for quick checks only",
    )
    p.add_argument(
        "--num_fewshot", type=int, default=None, help="few-shot examples (default: the task's)"
    )
    p.add_argument(
        "--batch_size", type=int, default=8, help="rows per forward (scoring) and per generation"
    )
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="context and KV cache length (default: the model's context, at most "
        f"{DEFAULT_MAX_SEQ_LENGTH})",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="compile the scoring forward (dynamic shapes) and the decode step",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default=None,
        help="weights and activations dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument("--output", type=Path, default=None, help="write the results here as JSON")
    p.add_argument(
        "--log_samples",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep every document's inputs and outputs (in --output)",
    )
    p.add_argument(
        "--bench_batching",
        type=int,
        default=None,
        metavar="N",
        help="instead of tasks, time N synthetic loglikelihood requests at batch size 1 and at "
        "--batch_size",
    )
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))

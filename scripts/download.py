# Downloads the files fastgen needs from a Hugging Face hub repository: weights (safetensors
# preferred, else pytorch_model*.bin), config and tokenizer files. Nothing else.
#
#   python scripts/download.py --repo_id meta-llama/Llama-3.1-8B-Instruct
#
# The token comes from HF_TOKEN or the login cache (`huggingface-cli login`), as
# huggingface_hub reads them; --hf_token overrides both.
import argparse
import fnmatch
import socket
import sys
import urllib.parse
from pathlib import Path

NEEDED = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "original/tokenizer.model",
]


def pick_files(repo_files: list[str]) -> list[str]:
    # Safetensors when the repo has them; .bin only as the fallback, never both.
    safetensors = [f for f in repo_files if fnmatch.fnmatch(f, "model*.safetensors*")]
    weights = safetensors or [f for f in repo_files if fnmatch.fnmatch(f, "pytorch_model*.bin*")]
    return sorted(set(weights) | {f for f in repo_files if f in NEEDED})


def hub_reachable(endpoint: str, timeout: float = 5.0) -> bool:
    # One quick TCP connect, so an offline machine fails in seconds, not after a minute of
    # huggingface_hub's retries.
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def download(repo_id: str, checkpoint_dir: Path, hf_token: str | None = None) -> Path:
    from huggingface_hub import constants, list_repo_files, snapshot_download

    if not hub_reachable(constants.ENDPOINT):
        raise RuntimeError(f"the hub at {constants.ENDPOINT} cannot be reached")

    files = pick_files(list_repo_files(repo_id, token=hf_token))
    if not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise RuntimeError(f"{repo_id} has no safetensors or pytorch_model.bin weights")
    # snapshot_download shows a progress bar per file on stderr.
    snapshot_download(repo_id, local_dir=checkpoint_dir, allow_patterns=files, token=hf_token)
    return checkpoint_dir


def main(repo_id: str, checkpoint_dir: Path | None, hf_token: str | None):
    checkpoint_dir = checkpoint_dir or Path("checkpoints") / repo_id
    try:
        download(repo_id, checkpoint_dir, hf_token)
    except ImportError:
        sys.exit("error: huggingface_hub is not installed (pip install huggingface_hub)")
    except Exception as e:  # noqa: BLE001 - network, auth and missing-repo errors all end here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        sys.exit(f"error: cannot download {repo_id}: {first}")
    print(f"downloaded {repo_id} to {checkpoint_dir}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Download a model's weights, config and tokenizer.")
    p.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument(
        "--checkpoint_dir",
        type=Path,
        default=None,
        help="where to put the files (default: checkpoints/REPO_ID)",
    )
    p.add_argument(
        "--hf_token", default=None, help="access token (default: HF_TOKEN or the login cache)"
    )
    return p


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))

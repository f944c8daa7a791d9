"""One small tokenizer interface over SentencePiece, tiktoken and Hugging Face tokenizer.json.

    python tokenizer.py --checkpoint_dir checkpoints/meta-llama/Meta-Llama-3-8B --text "Hello"
    python tokenizer.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \
        --chat "What is 2+2?" --system "Be brief."

get_tokenizer(checkpoint_dir) picks the backend from the files in the directory:
- tokenizer.json (HF `tokenizers`) when present;
- else tokenizer.model, read by its content: tiktoken (Llama-3 original format, lines of
  "base64-token rank") or SentencePiece (Llama-2, Mistral; a protobuf binary).
tokenizer_config.json, chat_template.jinja and generation_config.json beside it are read for any
backend when present.

Conventions, the same for every backend:
- encode() never lets the backend add special tokens; bos is prepended here, so `bos=` alone
  decides. bos=None means the model's default, `tok.add_bos`: tokenizer_config.json's
  add_bos_token when given; otherwise True for SentencePiece and tiktoken (when there is a bos
  token), and for tokenizer.json True only if its post_processor would prepend a token.
- `special_tokens` are the tokens that plain text never produces: SentencePiece control and unk
  pieces, the 256 Llama-3 tokens for tiktoken, added tokens marked special in tokenizer.json.
  encode(allow_special=False), the default, encodes their strings found in the text as plain text,
  so user input cannot inject <|eot_id|>. allow_special=True maps them to their ids; encode_chat()
  uses it for rendered templates. Tokens the backend always matches whole (tokenizer.json added
  tokens not marked special, SentencePiece user-defined pieces) are matched either way, as their
  own libraries do. `added_tokens` holds the special tokens plus those (for SentencePiece only the
  chat tags we look up: its Python API cannot list user-defined pieces); stop tokens and the
  built-in chat format are looked up there, never among ordinary BPE tokens.
- SentencePiece has no notion of special-token text, so with allow_special=True we split the text
  at special strings and encode each piece on its own; each piece gets SentencePiece's leading
  space, exactly as Meta's Llama-2 chat code does when it encodes turns separately.
- decode() renders every id, special tokens included, as its text; skip_special=True drops them.
"""

import argparse
import base64
import functools
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import sentencepiece
import tiktoken
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(Exception):
    """A tokenizer that cannot be found, read or used; the message is one line for the user."""


# ---------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------

# Llama-3's pre-tokenizer regex (same as Meta's reference tokenizer and HF's conversion).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_N_SPECIAL = 256

# Tokens that end a turn or a document; whichever of them the vocab has are stop tokens.
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "</s>",
    "<end_of_turn>",
    "<|endoftext|>",
)

# Tokens whose presence picks a built-in chat format.
CHAT_FORMAT_TOKENS = ("<|start_header_id|>",)

# The named special tokens transformers passes to chat templates (its special_tokens_map).
TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Built-in chat formats for checkpoints that ship no template. Written for the same Jinja
# environment as the models' own templates; they never contain newlines of their own, so
# trim_blocks/lstrip_blocks cannot change them.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Meta's Llama-2 chat format: the system prompt goes inside the first [INST] block.
LLAMA2_CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = '<<SYS>>\n' + message['content'] | trim + '\n<</SYS>>\n\n' %}"
    "{% elif message['role'] == 'user' %}"
    "{{ bos_token }}[INST] {{ ns.system }}{{ message['content'] | trim }} [/INST]"
    "{% set ns.system = '' %}"
    "{% else %}"
    " {{ message['content'] | trim }} {{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------


@dataclass
class Tokenizer:
    """A loaded tokenizer; build it with get_tokenizer(). The backend lives in the callables."""

    backend: str  # "sentencepiece" | "tiktoken" | "tokenizers"
    vocab_size: int
    special_tokens: dict[str, int]  # what allow_special governs
    added_tokens: dict[str, int]  # special_tokens plus tokens matched whole even as plain text
    encode_text: Callable[[str, bool], list[int]] = field(repr=False)  # (text, allow_special)
    decode_ids: Callable[[list[int]], str] = field(repr=False)
    token_to_id: Callable[[str], int | None] = field(repr=False)
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    stop_ids: set[int] = field(default_factory=set)
    chat_template: str = PLAIN_CHAT_TEMPLATE
    template_vars: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...

    def encode(self, text: str, bos: bool | None = None, allow_special: bool = False) -> list[int]:
        if bos is None:
            bos = self.add_bos
        ids = self.encode_text(text, allow_special)
        if not bos:
            return ids
        if self.bos_id is None:
            raise TokenizerError("bos=True, but this tokenizer has no bos token")
        return [self.bos_id, *ids]

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if skip_special:
            special_ids = set(self.special_tokens.values())
            ids = [i for i in ids if i not in special_ids]
        return self.decode_ids(list(ids))

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        # transformers drops keys whose value is None (e.g. OpenAI's content=None) because
        # templates test `'key' in message`; do the same so both render the same text.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            template = compile_chat_template(self.chat_template)
            return template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.template_vars,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        # Templates write bos themselves when the model wants it, so we add none here. Special
        # strings anywhere in the rendered text become tokens, message contents included, as
        # in transformers' apply_chat_template.
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, bos=False, allow_special=True)


class StreamDecoder:
    """Turns generated ids, one at a time, into text pieces that concatenate to tok.decode(ids).

    Decoding each token on its own is wrong twice over: a multi-byte character can be split over
    several byte tokens, and SentencePiece drops the leading space of the first piece it decodes.
    So push() decodes a short window (the ids emitted last time as left context, plus the ids not
    yet emitted) with and without the pending ids, and emits the difference. A trailing U+FFFD
    means an incomplete character: hold it back until a later token completes it. Each push costs
    O(window), not O(ids so far).
    """

    # A character is at most 4 UTF-8 bytes, so an incomplete one spans at most 3 tokens; a U+FFFD
    # still there after 4 pending tokens is real (invalid bytes or a generated U+FFFD).
    max_pending = 4

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self.tok = tok
        self.skip_special = skip_special
        self.window: list[int] = []  # [context ids..., pending ids...]
        self.n_context = 0

    def push(self, token_id: int) -> str:
        self.window.append(token_id)
        full = self.tok.decode(self.window, self.skip_special)
        n_pending = len(self.window) - self.n_context
        if full.endswith("\ufffd") and n_pending < self.max_pending:
            return ""
        return self._emit(full)

    def flush(self) -> str:
        """Whatever is held back (an unfinished character at the end of generation)."""
        if len(self.window) == self.n_context:
            return ""
        return self._emit(self.tok.decode(self.window, self.skip_special))

    def _emit(self, full: str) -> str:
        context = self.tok.decode(self.window[: self.n_context], self.skip_special)
        self.window = self.window[self.n_context :]  # the pending ids become the next context
        self.n_context = len(self.window)
        return full[len(context) :]


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks assistant text with it for
    training masks; for inference it just renders its body. Without it such templates fail to
    parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationBlock],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def read_chat_template(checkpoint_dir: Path, config: dict) -> str | None:
    """The checkpoint's own template: chat_template.jinja, else tokenizer_config's chat_template."""
    path = checkpoint_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # A list of named templates (e.g. "default", "tool_use", "rag"); we render "default".
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def default_chat_template(added_tokens: dict[str, int], bos: str | None, eos: str | None) -> str:
    """A built-in format, chosen by the tokens the vocab has."""
    if "<|start_header_id|>" in added_tokens:
        return LLAMA3_CHAT_TEMPLATE
    if bos == "<s>" and eos == "</s>":
        return LLAMA2_CHAT_TEMPLATE
    return PLAIN_CHAT_TEMPLATE


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


def special_tokens_pattern(specials: dict[str, int]) -> re.Pattern:
    # Longest first, so a token wins over any special token it contains; (?!) never matches.
    alternatives = sorted(specials, key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in alternatives) or "(?!)")


def encode_with_specials(
    text: str,
    pattern: re.Pattern,
    specials: dict[str, int],
    encode_plain: Callable[[str], list[int]],
) -> list[int]:
    """Map special-token strings in text to their ids and encode the text between them."""
    ids, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            ids += encode_plain(text[start : match.start()])
        ids.append(specials[match.group()])
        start = match.end()
    if start < len(text):
        ids += encode_plain(text[start:])
    return ids


def load_sentencepiece(data: bytes) -> Tokenizer:
    sp = sentencepiece.SentencePieceProcessor(model_proto=data)
    n_pieces = sp.get_piece_size()
    if n_pieces == 0:
        # An empty or unrelated protobuf parses without error but holds no vocabulary.
        raise ValueError("no pieces")
    special_tokens = {
        sp.id_to_piece(i): i for i in range(n_pieces) if sp.is_control(i) or sp.is_unknown(i)
    }
    special_text = {i: s for s, i in special_tokens.items()}
    pattern = special_tokens_pattern(special_tokens)

    def encode_text(text: str, allow_special: bool) -> list[int]:
        if not allow_special:
            return sp.encode(text)
        return encode_with_specials(text, pattern, special_tokens, sp.encode)

    def decode_ids(ids: list[int]) -> str:
        # sp.decode drops control pieces; render them as text, like the other backends do.
        parts, run = [], []
        for i in ids:
            if i in special_text:
                parts += [sp.decode(run), special_text[i]]
                run = []
            else:
                run.append(i)
        parts.append(sp.decode(run))
        return "".join(parts)

    def token_to_id(token: str) -> int | None:
        i = sp.piece_to_id(token)
        return i if sp.id_to_piece(i) == token else None  # unknown pieces map to unk

    # The Python API cannot list user-defined pieces (which sentencepiece matches whole in text,
    # e.g. Gemma's <end_of_turn>). A learned piece spelling a chat tag is implausible, so the
    # tags we care about count as added tokens when the vocab has them.
    added_tokens = dict(special_tokens)
    for tag in (*END_OF_TURN_TOKENS, *CHAT_FORMAT_TOKENS):
        i = token_to_id(tag)
        if i is not None and not sp.is_byte(i):
            added_tokens[tag] = i

    bos, eos = sp.bos_id(), sp.eos_id()
    return Tokenizer(
        backend="sentencepiece",
        vocab_size=n_pieces,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        encode_text=encode_text,
        decode_ids=decode_ids,
        token_to_id=token_to_id,
        bos_id=bos if bos >= 0 else None,
        eos_id=eos if eos >= 0 else None,
        add_bos=bos >= 0,
    )


def is_tiktoken_file(data: bytes) -> bool:
    """tiktoken files are text lines "base64-token rank"; a SentencePiece protobuf never
    starts like that (its first byte is a field tag, 0x0a)."""
    first_line = data.split(b"\n", 1)[0].rstrip(b"\r")
    return re.fullmatch(rb"[A-Za-z0-9+/]+={0,2} \d+", first_line) is not None


def parse_tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    return ranks


def llama3_special_tokens(n_base: int) -> dict[str, int]:
    """Llama-3's 256 special tokens, numbered after the mergeable ranks. Names follow Llama 3.1;
    3.0 called ids 4, 5, 8 and 10 reserved tokens, but the ids used by both are the same."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_N_SPECIAL - len(named))]
    return {token: n_base + i for i, token in enumerate(named + reserved)}


def load_tiktoken(data: bytes) -> Tokenizer:
    ranks = parse_tiktoken_ranks(data)
    special_tokens = llama3_special_tokens(len(ranks))
    enc = tiktoken.Encoding(
        name="llama3",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=special_tokens,
    )

    def encode_text(text: str, allow_special: bool) -> list[int]:
        if allow_special:
            return enc.encode(text, allowed_special="all")
        return enc.encode_ordinary(text)

    def token_to_id(token: str) -> int | None:
        if token in special_tokens:
            return special_tokens[token]
        return ranks.get(token.encode("utf-8"))

    return Tokenizer(
        backend="tiktoken",
        vocab_size=enc.n_vocab,
        special_tokens=special_tokens,
        added_tokens=dict(special_tokens),
        encode_text=encode_text,
        decode_ids=enc.decode,  # errors="replace": incomplete UTF-8 shows as U+FFFD
        token_to_id=token_to_id,
        bos_id=special_tokens["<|begin_of_text|>"],
        eos_id=special_tokens["<|end_of_text|>"],
        add_bos=True,
    )


def post_processor_prefix(processor: dict | None) -> int | None:
    """The id of the special token a TemplateProcessing post_processor puts before a single
    sequence (Llama-3's <|begin_of_text|>, Llama-2's <s>); None if it adds nothing in front."""
    if not processor:
        return None
    if processor.get("type") == "Sequence":
        found = [post_processor_prefix(p) for p in processor.get("processors", [])]
        return next((i for i in found if i is not None), None)
    if processor.get("type") != "TemplateProcessing" or not processor.get("single"):
        return None
    first = processor["single"][0].get("SpecialToken")
    if first is None:
        return None
    ids = processor.get("special_tokens", {}).get(first["id"], {}).get("ids")
    return ids[0] if ids else None


def load_tokenizers_json(text: str) -> Tokenizer:
    try:
        spec = json.loads(text)
        tok = tokenizers.Tokenizer.from_str(text)
    # tokenizers raises a bare Exception for malformed files, so nothing narrower works.
    except Exception as e:
        raise ValueError(str(e)) from e
    # A second copy that encodes special tokens as text; tokenizers has no per-call switch and
    # flipping the flag on a shared object is not thread-safe.
    plain = tokenizers.Tokenizer.from_str(text)
    plain.encode_special_tokens = True
    added = tok.get_added_tokens_decoder()  # {id: AddedToken}
    special_tokens = {t.content: i for i, t in added.items() if t.special}
    added_tokens = {t.content: i for i, t in added.items()}

    def encode_text(text: str, allow_special: bool) -> list[int]:
        backend = tok if allow_special else plain
        return backend.encode(text, add_special_tokens=False).ids

    def decode_ids(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    bos = post_processor_prefix(spec.get("post_processor"))
    return Tokenizer(
        backend="tokenizers",
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        encode_text=encode_text,
        decode_ids=decode_ids,
        token_to_id=tok.token_to_id,
        bos_id=bos,
        eos_id=None,  # only tokenizer_config.json names it
        add_bos=bos is not None,
    )


# ---------------------------------------------------------------------------------------------
# Loading a checkpoint directory
# ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise TokenizerError(f"cannot read {path}: expected a JSON object")
    return value


def token_content(value: object) -> str | None:
    """tokenizer_config.json writes tokens as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_backend(checkpoint_dir: Path) -> Tokenizer:
    json_path = checkpoint_dir / "tokenizer.json"
    model_path = checkpoint_dir / "tokenizer.model"
    if json_path.is_file():
        try:
            return load_tokenizers_json(json_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            raise TokenizerError(f"cannot read {json_path}: {e}") from e
    if model_path.is_file():
        try:
            data = model_path.read_bytes()
        except OSError as e:
            raise TokenizerError(f"cannot read {model_path}: {e}") from e
        if is_tiktoken_file(data):
            try:
                return load_tiktoken(data)
            except ValueError as e:  # binascii.Error is a ValueError
                raise TokenizerError(f"cannot read {model_path} as a tiktoken file: {e}") from e
        try:
            return load_sentencepiece(data)
        except (RuntimeError, ValueError) as e:
            raise TokenizerError(
                f"cannot read {model_path}: neither a SentencePiece model nor a tiktoken file"
            ) from e
    raise TokenizerError(
        f"no tokenizer in {checkpoint_dir}: expected tokenizer.json or tokenizer.model"
    )


def get_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (see the module docstring for the rules)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise TokenizerError(f"tokenizer directory {checkpoint_dir} does not exist")
    tok = load_backend(checkpoint_dir)
    config_path = checkpoint_dir / "tokenizer_config.json"
    config = read_json(config_path)

    def config_token_id(name: str, default: int | None) -> int | None:
        if name not in config:
            return default
        content = token_content(config[name])
        if content is None:
            return None  # e.g. Qwen's "bos_token": null: the model has none
        token_id = tok.token_to_id(content)
        if token_id is None:
            raise TokenizerError(f"{config_path}: {name} {content!r} is not in the vocabulary")
        return token_id

    bos_id = config_token_id("bos_token", tok.bos_id)
    eos_id = config_token_id("eos_token", tok.eos_id)
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = tok.add_bos
    add_bos = bool(add_bos) and bos_id is not None

    id_text = {i: s for s, i in tok.added_tokens.items()}
    template_vars = {}
    for name in TEMPLATE_TOKEN_NAMES:
        content = token_content(config.get(name))
        if content is not None:
            template_vars[name] = content
    for name, token_id in (("bos_token", bos_id), ("eos_token", eos_id)):
        if name not in template_vars and token_id is not None:
            template_vars[name] = id_text.get(token_id) or tok.decode_ids([token_id])

    chat_template = read_chat_template(checkpoint_dir, config)
    if chat_template is None:
        chat_template = default_chat_template(
            tok.added_tokens, template_vars.get("bos_token"), template_vars.get("eos_token")
        )
        if chat_template == PLAIN_CHAT_TEMPLATE and add_bos:
            chat_template = "{{ bos_token }}" + chat_template

    stop_ids = {tok.added_tokens[t] for t in END_OF_TURN_TOKENS if t in tok.added_tokens}
    if eos_id is not None:
        stop_ids.add(eos_id)
    generation_eos = read_json(checkpoint_dir / "generation_config.json").get("eos_token_id")
    if isinstance(generation_eos, int):
        generation_eos = [generation_eos]
    stop_ids.update(i for i in generation_eos or [] if isinstance(i, int))

    return replace(
        tok,
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=add_bos,
        stop_ids=stop_ids,
        chat_template=chat_template,
        template_vars=template_vars,
    )


# ---------------------------------------------------------------------------------------------
# CLI: inspect a checkpoint's tokenizer
# ---------------------------------------------------------------------------------------------


def main(
    checkpoint_dir: Path, text: str | None, chat: str | None, system: str | None, bos: bool | None
) -> None:
    try:
        tok = get_tokenizer(checkpoint_dir)
        if chat is not None:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": chat})
            text = tok.apply_chat_template(messages)
            ids = tok.encode_chat(messages)
        else:
            ids = tok.encode(text or "", bos=bos)
    except TokenizerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(
        f"backend={tok.backend} vocab_size={tok.vocab_size} bos_id={tok.bos_id} "
        f"eos_id={tok.eos_id} add_bos={tok.add_bos} stop_ids={sorted(tok.stop_ids)}",
        file=sys.stderr,
    )
    if chat is not None:
        print(text, file=sys.stderr)
    print(ids)
    print(repr(tok.decode(ids)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Encode text with a checkpoint's tokenizer.")
    parser.add_argument("--checkpoint_dir", type=Path, required=True)
    parser.add_argument("--text", type=str, default="Hello, world!", help="text to encode")
    parser.add_argument("--chat", type=str, default=None, help="a user message to render")
    parser.add_argument("--system", type=str, default=None, help="system prompt for --chat")
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepend bos to --text (default: the model's add_bos)",
    )
    return parser


if __name__ == "__main__":
    main(**vars(build_parser().parse_args()))

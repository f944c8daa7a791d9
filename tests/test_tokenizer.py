"""Tests for tokenizer.py: each backend against its own library, chats against transformers.

    python -m pytest tests/test_tokenizer.py -q

Every tokenizer is built here from a small generated corpus (no network, a few seconds).
"""

import base64
import collections
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import regex
import sentencepiece
import tiktoken
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import tokenizer as fastgen_tokenizer
from tokenizer import StreamDecoder, TokenizerError, get_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent

# Text the tokenizers were not trained on as well as text they were: unicode, emoji (some unseen,
# so they fall back to bytes), digits, whitespace runs, code.
SAMPLE_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "numbers 1234567890 and 3.14159, 42nd",
    "  leading spaces and trailing   ",
    "tabs\tand\n\nnewlines\r\n  indented",
    "unicode: naïve café, Straße, 日本語のテキスト, Привет мир",
    "emoji: 🦙🚀 👍🏽 family 👨‍👩‍👧",
    'def f(x):\n    return {"a": [x ** 2 for x in range(10)]}  # comment\n',
    "I'm sure they'll say we've done it, didn't we? THEY'LLAMA",
    "",
    " ",
    "a",
]

MESSAGES = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3+3?  "},
    ],
    [
        {"role": "user", "content": "Tell me about 日本 🦙"},
        {"role": "assistant", "content": "Sure.\n\nIt's <b>nice</b>.", "tool_calls": None},
        {"role": "user", "content": "More."},
    ],
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shaped like Llama-3's own template (one line): bos on the first message, trimmed content.
LLAMA3_STYLE_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|im_start|>' + message['role'] + '<|im_end|>\n\n'"
    "+ message['content'] | trim + '<|endoftext|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\n\n' }}{% endif %}"
)

# Exercises raise_exception, loop.last, namespace, tojson (no HTML escaping), strftime_now,
# {% break %} (loopcontrols) and whitespace control.
CHECKED_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- if ns.system %}<<{{ ns.system }}>>{% endif %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {%- if message['content'] == 'STOP' %}{% break %}{% endif %}
    {{ message['role'] | upper }}: {{ message['content'] | tojson }}
    {%- if loop.last %} [last]{% endif %}

{% endfor %}
{%- if tools is not none %}TOOLS {{ tools | tojson }}{% endif %}
{%- if add_generation_prompt %}ASSISTANT ({{ strftime_now('%Y') | length }}):{% endif %}"""


def corpus_lines(n: int = 1500) -> list[str]:
    rng = random.Random(0)
    words = (
        "the quick brown fox jumps over lazy dog hello world token model generate python "
        "return value function class def import self print data text chat user assistant "
        "naïve café Straße 日本語 テキスト Привет мир 🚀 👍"
    ).split()
    lines = [
        " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + f" {rng.randint(0, 99999)}"
        for _ in range(n)
    ]
    lines += ["def f(x):\n    return x ** 2  # square", "if a == b:\n\tprint('yes')"] * 20
    return lines


# ---------------------------------------------------------------------------------------------
# Building tiny tokenizers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sp")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines()), encoding="utf-8")
    # Llama-2's settings: BPE with byte fallback, no normalization, digits split.
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "sp"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    shutil.copy(root / "sp.model", checkpoint / "tokenizer.model")
    return checkpoint


def learn_byte_bpe(text: str, n_merges: int) -> dict[bytes, int]:
    """A few rounds of byte-level BPE training: merge the most frequent adjacent pair."""
    ranks = {bytes([b]): b for b in range(256)}
    chunks = collections.Counter(regex.findall(fastgen_tokenizer.LLAMA3_PATTERN, text))
    words = {tuple(bytes([b]) for b in chunk.encode()): n for chunk, n in chunks.items()}
    for _ in range(n_merges):
        pairs = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return ranks


@pytest.fixture(scope="module")
def tiktoken_ranks() -> dict[bytes, int]:
    ranks = learn_byte_bpe("\n".join(corpus_lines(300)), n_merges=60)
    # Tokens (and the prefixes that build them) spanning places where the regex splits or not,
    # so that a wrong pre-tokenizer pattern changes the ids.
    for text in ["1234567890", "o, w", "world!", "  lead", "ing   ", "\t\n", "I'm", "'LLAMA"]:
        raw = text.encode()
        for end in range(2, len(raw) + 1):
            ranks.setdefault(raw[:end], len(ranks))
    return ranks


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory: pytest.TempPathFactory, tiktoken_ranks: dict) -> Path:
    checkpoint = tmp_path_factory.mktemp("tiktoken")
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in tiktoken_ranks.items()]
    (checkpoint / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return checkpoint


HF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=HF_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.add_tokens([tokenizers.AddedToken("<think>", special=False)])
    # Like Llama-3's tokenizer.json: the post-processor is what adds bos.
    bos_id = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|endoftext|> $A",
                pair="<|endoftext|> $A <|endoftext|> $B",
                special_tokens=[("<|endoftext|>", bos_id)],
            ),
        ]
    )
    path = tmp_path_factory.mktemp("hf_json") / "tokenizer.json"
    tok.save(str(path))
    return path


def make_hf_dir(root: Path, tokenizer_json: Path, **config: object) -> Path:
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    shutil.copy(tokenizer_json, checkpoint / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        # The dict form older checkpoints write; transformers reads it through "__type".
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        **config,
    }
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    return checkpoint


@pytest.fixture
def hf_dir(tmp_path: Path, hf_tokenizer_json: Path) -> Path:
    return make_hf_dir(tmp_path, hf_tokenizer_json, chat_template=CHATML_TEMPLATE)


def hf_reference(checkpoint: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint))


# ---------------------------------------------------------------------------------------------
# SentencePiece
# ---------------------------------------------------------------------------------------------


def test_sentencepiece_matches_library(sp_dir: Path):
    tok = get_tokenizer(sp_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    assert tok.backend == "sentencepiece"
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, sp.get_piece_size())
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert tok.add_bos and tok.stop_ids == {2}
    byte_fallbacks = 0
    for text in SAMPLE_TEXTS:
        expected = sp.encode(text)
        byte_fallbacks += sum(sp.is_byte(i) for i in expected)
        assert tok.encode(text, bos=False) == expected, text
        assert tok.encode(text) == [1, *expected], text
        assert tok.decode(expected) == text
    assert byte_fallbacks > 0  # the unseen emoji really went through byte pieces


def test_sentencepiece_special_tokens(sp_dir: Path):
    tok = get_tokenizer(sp_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    text = "<s>[INST] hi [/INST] ok </s><s>"
    # As text, <s> is just characters; recognised, it splits the text into separately encoded runs.
    assert tok.encode(text, bos=False) == sp.encode(text)
    expected = [1, *sp.encode("[INST] hi [/INST] ok "), 2, 1]
    assert tok.encode(text, bos=False, allow_special=True) == expected
    assert tok.decode(expected) == text
    assert tok.decode(expected, skip_special=True) == "[INST] hi [/INST] ok "


def test_sentencepiece_llama2_chat_fallback(sp_dir: Path):
    tok = get_tokenizer(sp_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    messages = MESSAGES[2]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is 2+2? [/INST] 4 </s>"
        "<s>[INST] And 3+3? [/INST]"
    )
    # The same ids Meta's Llama-2 chat code builds: bos + turn + eos per exchange.
    turn1 = "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is 2+2? [/INST] 4 "
    expected = [1, *sp.encode(turn1), 2, 1, *sp.encode("[INST] And 3+3? [/INST]")]
    assert tok.encode_chat(messages) == expected


def test_sentencepiece_tokenizer_config_overrides(tmp_path: Path, sp_dir: Path):
    shutil.copy(sp_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    config = {"add_bos_token": False, "eos_token": {"content": "<unk>"}, "chat_template": "X"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = get_tokenizer(tmp_path)
    assert not tok.add_bos and tok.encode("hi") == tok.encode("hi", bos=False)
    assert tok.encode("hi", bos=True)[0] == 1
    assert tok.eos_id == 0 and tok.stop_ids == {0, 2}  # </s> is still an end-of-turn token
    assert tok.apply_chat_template(MESSAGES[0]) == "X"


# ---------------------------------------------------------------------------------------------
# tiktoken
# ---------------------------------------------------------------------------------------------


def test_tiktoken_matches_library(tiktoken_dir: Path, tiktoken_ranks: dict):
    tok = get_tokenizer(tiktoken_dir)
    n = len(tiktoken_ranks)
    assert tok.backend == "tiktoken"
    assert len(tok.special_tokens) == 256 and tok.vocab_size == n + 256
    assert sorted(tok.special_tokens.values()) == list(range(n, n + 256))
    for name, offset in [
        ("<|begin_of_text|>", 0),
        ("<|end_of_text|>", 1),
        ("<|reserved_special_token_0|>", 2),
        ("<|start_header_id|>", 6),
        ("<|end_header_id|>", 7),
        ("<|eom_id|>", 8),
        ("<|eot_id|>", 9),
        ("<|python_tag|>", 10),
        ("<|reserved_special_token_246|>", 255),
    ]:
        assert tok.special_tokens[name] == n + offset, name
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (n, n + 1, True)
    assert tok.stop_ids == {n + 1, n + 8, n + 9}

    reference = tiktoken.Encoding(
        name="reference",
        pat_str=fastgen_tokenizer.LLAMA3_PATTERN,
        mergeable_ranks=tiktoken_ranks,
        special_tokens=tok.special_tokens,
    )
    merged = 0
    for text in SAMPLE_TEXTS:
        expected = reference.encode(text, disallowed_special=())
        merged += sum(i >= 256 for i in expected)
        assert tok.encode(text, bos=False) == expected, text
        assert tok.encode(text) == [n, *expected]
        assert tok.decode(expected) == text
    assert merged > 0  # the learned merges are used


def test_tiktoken_pattern_matches_transformers_conversion(tiktoken_dir: Path):
    """transformers' own Llama-3 conversion (its pattern, not ours) gives the same ids."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    tok = get_tokenizer(tiktoken_dir)
    converted = convert.TikTokenConverter(
        vocab_file=str(tiktoken_dir / "tokenizer.model"),
        extra_special_tokens=list(tok.special_tokens),
    ).converted()
    for text in SAMPLE_TEXTS:
        assert tok.encode(text, bos=False) == converted.encode(text).ids, text
    text = "<|begin_of_text|>hi<|eot_id|>"
    assert tok.encode(text, bos=False, allow_special=True) == converted.encode(text).ids


def test_tiktoken_special_tokens_and_chat_fallback(tiktoken_dir: Path, tiktoken_ranks: dict):
    tok = get_tokenizer(tiktoken_dir)
    n = len(tiktoken_ranks)
    text = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    ids = tok.encode(text, bos=False, allow_special=True)
    assert ids[0] == n + 6 and ids[-1] == n + 9 and n + 7 in ids
    plain = tok.encode(text, bos=False)
    assert all(i < n for i in plain)  # allow_special=False: the strings are just text
    assert tok.decode(ids) == tok.decode(plain) == text
    assert tok.decode(ids, skip_special=True) == "user\n\nhi"

    messages = MESSAGES[2]
    rendered = tok.apply_chat_template(messages)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode_chat(messages)
    assert ids[:2] == [n, n + 6] and ids.count(n) == 1  # exactly one bos
    assert tok.decode(ids) == rendered
    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without_prompt == rendered.removesuffix(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# ---------------------------------------------------------------------------------------------
# tokenizer.json
# ---------------------------------------------------------------------------------------------


def test_tokenizers_json_matches_libraries(hf_dir: Path):
    tok = get_tokenizer(hf_dir)
    reference = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    hf = hf_reference(hf_dir)
    transformers = pytest.importorskip("transformers")
    from_file = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    bos, eos = reference.token_to_id("<|endoftext|>"), reference.token_to_id("<|im_end|>")
    assert tok.backend == "tokenizers"
    assert tok.special_tokens == {t: reference.token_to_id(t) for t in HF_SPECIALS}
    assert tok.added_tokens["<think>"] == reference.token_to_id("<think>")
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (bos, eos, reference.get_vocab_size())
    assert tok.add_bos  # unspecified in the config, but the post_processor prepends bos
    for text in SAMPLE_TEXTS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, bos=False) == expected, text
        assert hf.encode(text, add_special_tokens=False) == expected, text
        assert from_file.encode(text, add_special_tokens=False) == expected, text
        assert tok.encode(text) == hf.encode(text) == [bos, *expected], text
        assert tok.decode(expected) == text

    text = "<|im_start|>user\nhi <think>x</think><|im_end|>"
    special = tok.encode(text, bos=False, allow_special=True)
    assert special == hf.encode(text, add_special_tokens=False)
    assert special[0] == tok.special_tokens["<|im_start|>"]
    plain = tok.encode(text, bos=False)
    assert not set(plain) & set(tok.special_tokens.values())
    assert tok.added_tokens["<think>"] in plain  # a non-special added token is matched either way
    assert tok.decode(plain) == tok.decode(special) == text
    assert tok.decode(special, skip_special=True) == "user\nhi <think>x</think>"


def test_tokenizers_json_add_bos_from_config(tmp_path: Path, hf_tokenizer_json: Path):
    tok = get_tokenizer(make_hf_dir(tmp_path, hf_tokenizer_json, add_bos_token=False))
    assert tok.bos_id is not None and not tok.add_bos
    assert tok.encode("hi") == tok.encode("hi", bos=False)
    assert tok.encode("hi", bos=True) == [tok.bos_id, *tok.encode("hi", bos=False)]


def test_tokenizers_json_without_bos(tmp_path: Path, hf_tokenizer_json: Path):
    # Qwen-style: no bos at all, and a post-processor that adds nothing.
    no_bos = tokenizers.Tokenizer.from_file(str(hf_tokenizer_json))
    no_bos.post_processor = processors.ByteLevel(trim_offsets=False)
    plain_json = tmp_path / "tokenizer.json"
    no_bos.save(str(plain_json))
    (tmp_path / "x").mkdir()
    tok = get_tokenizer(make_hf_dir(tmp_path / "x", plain_json, bos_token=None))
    assert tok.bos_id is None and not tok.add_bos
    assert tok.encode("hi") == tok.encode("hi", bos=False)
    with pytest.raises(TokenizerError):
        tok.encode("hi", bos=True)


@pytest.mark.parametrize(
    "template",
    [CHATML_TEMPLATE, LLAMA3_STYLE_TEMPLATE, CHECKED_TEMPLATE],
    ids=["chatml", "llama3_style", "checked"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tmp_path: Path, hf_tokenizer_json: Path, template: str, add_generation_prompt: bool
):
    checkpoint = make_hf_dir(tmp_path, hf_tokenizer_json, chat_template=template)
    tok = get_tokenizer(checkpoint)
    hf = hf_reference(checkpoint)
    for messages in MESSAGES:
        kwargs = {"add_generation_prompt": add_generation_prompt}
        expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert tok.apply_chat_template(messages, **kwargs) == expected
        expected_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert tok.encode_chat(messages, **kwargs) == expected_ids
    if template != CHATML_TEMPLATE:
        ids = tok.encode_chat(MESSAGES[0])
        assert ids[0] == tok.bos_id != ids[1]  # the template's bos, and no second one


def test_chat_template_tools_and_errors(tmp_path: Path, hf_tokenizer_json: Path):
    tok = get_tokenizer(make_hf_dir(tmp_path, hf_tokenizer_json, chat_template=CHECKED_TEMPLATE))
    hf = hf_reference(tmp_path / "checkpoint")
    tools = [{"type": "function", "function": {"name": "f", "description": "a <b> & 'c'"}}]
    expected = hf.apply_chat_template(
        MESSAGES[1], tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert tok.apply_chat_template(MESSAGES[1], tools=tools) == expected
    assert "<b> & 'c'" in expected  # tojson must not escape HTML

    stopped = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "STOP"}]
    expected = hf.apply_chat_template(stopped, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(stopped) == expected

    not_alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TokenizerError, match="must alternate"):
        tok.apply_chat_template(not_alternating)
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        hf.apply_chat_template(not_alternating, tokenize=False)


def test_chat_template_sources(tmp_path: Path, hf_tokenizer_json: Path):
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": CHATML_TEMPLATE},
    ]
    checkpoint = make_hf_dir(tmp_path, hf_tokenizer_json, chat_template=named)
    tok = get_tokenizer(checkpoint)
    hf = hf_reference(checkpoint)
    assert tok.apply_chat_template(MESSAGES[1]) == hf.apply_chat_template(
        MESSAGES[1], tokenize=False, add_generation_prompt=True
    )
    # A chat_template.jinja file beside the config wins, as in transformers.
    (checkpoint / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% endfor %}"
    )
    assert get_tokenizer(checkpoint).apply_chat_template(MESSAGES[1]) == "[system][user]"
    # {% generation %} blocks (assistant masks in transformers) render their body.
    (checkpoint / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    )
    assert get_tokenizer(checkpoint).apply_chat_template(MESSAGES[0]) == "<Hi there!>"


def test_plain_chat_fallback(tmp_path: Path, hf_tokenizer_json: Path):
    # No template and neither Llama-2 nor Llama-3 tokens in the vocab: "role: content" lines.
    tok = get_tokenizer(make_hf_dir(tmp_path, hf_tokenizer_json))
    assert tok.apply_chat_template(MESSAGES[1]) == (
        "<|endoftext|>system: You are terse.\nuser: What is 2+2?\nassistant:"
    )
    assert tok.encode_chat(MESSAGES[1]).count(tok.bos_id) == 1


# ---------------------------------------------------------------------------------------------
# Stop tokens
# ---------------------------------------------------------------------------------------------


def test_stop_ids(hf_dir: Path):
    tok = get_tokenizer(hf_dir)
    im_end, endoftext = tok.special_tokens["<|im_end|>"], tok.special_tokens["<|endoftext|>"]
    assert tok.eos_id == im_end
    assert tok.stop_ids == {im_end, endoftext}
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    assert get_tokenizer(hf_dir).stop_ids == {im_end, endoftext, 7, 11}
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 13}))
    assert get_tokenizer(hf_dir).stop_ids == {im_end, endoftext, 13}


# ---------------------------------------------------------------------------------------------
# Streaming decode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["sp_dir", "tiktoken_dir", "hf_dir"])
def test_stream_decoder(request: pytest.FixtureRequest, fixture: str):
    tok = get_tokenizer(request.getfixturevalue(fixture))
    text = "".join(SAMPLE_TEXTS) + " 🦙🦙 end <|im_end|>"
    ids = tok.encode(text, allow_special=True) + tok.encode(" tail 🦙", bos=False)
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[1:]  # some emoji byte tokens really were held back
    assert len(decoder.window) <= 2 * StreamDecoder.max_pending  # not the whole history
    assert decoder.flush() == ""

    decoder = StreamDecoder(tok, skip_special=True)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special=True)


def test_stream_decoder_flush_and_invalid_bytes(tiktoken_dir: Path, tiktoken_ranks: dict):
    tok = get_tokenizer(tiktoken_dir)
    lead, cont = tiktoken_ranks[b"\xf0"], tiktoken_ranks[b"\x9f"]  # start of a 4-byte character
    decoder = StreamDecoder(tok)
    assert decoder.push(lead) == decoder.push(cont) == ""
    assert decoder.flush() == tok.decode([lead, cont])  # an unfinished character at the end
    assert decoder.flush() == ""
    # Stray continuation bytes never complete; they come out after max_pending tokens.
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(cont) for _ in range(6)]
    assert pieces[: StreamDecoder.max_pending - 1] == [""] * (StreamDecoder.max_pending - 1)
    assert "".join(pieces) + decoder.flush() == tok.decode([cont] * 6)


# ---------------------------------------------------------------------------------------------
# Errors and CLI
# ---------------------------------------------------------------------------------------------


def test_errors(tmp_path: Path, hf_tokenizer_json: Path):
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        get_tokenizer(tmp_path)  # empty
    with pytest.raises(TokenizerError, match="does not exist"):
        get_tokenizer(tmp_path / "missing")

    (tmp_path / "tokenizer.model").write_bytes(
        bytes(random.Random(0).randrange(256) for _ in range(999))
    )
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        get_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        get_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nnot base64! 1\n")
    with pytest.raises(TokenizerError, match="tiktoken"):
        get_tokenizer(tmp_path)

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        get_tokenizer(tmp_path)

    (tmp_path / "bad").mkdir()
    bad_config = make_hf_dir(tmp_path / "bad", hf_tokenizer_json, eos_token="<|nope|>")
    with pytest.raises(TokenizerError, match="eos_token"):
        get_tokenizer(bad_config)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO_ROOT / "tokenizer.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_cli(hf_dir: Path, tmp_path: Path):
    assert run_cli("--help").returncode == 0
    result = run_cli("--checkpoint_dir", str(hf_dir), "--text", "hello world", "--no-bos")
    assert result.returncode == 0, result.stderr
    tok = get_tokenizer(hf_dir)
    assert result.stdout.splitlines()[0] == str(tok.encode("hello world", bos=False))
    result = run_cli("--checkpoint_dir", str(hf_dir), "--chat", "hi", "--system", "be brief")
    assert result.returncode == 0, result.stderr
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert result.stdout.splitlines()[0] == str(tok.encode_chat(messages))
    # A user error: one line on stderr, no traceback, non-zero exit.
    result = run_cli("--checkpoint_dir", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "missing" in result.stderr

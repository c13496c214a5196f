"""Chat templates and loss masks against transformers' own ``apply_chat_template``: the same
token ids and the same assistant mask (``return_assistant_tokens_mask=True``), for the tiny
Llama's template (a chat_template.jinja file, made by scripts/make_tiny_hf.py) and for a
template kept in tokenizer_config.json."""
import json
import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.fast

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")

from zeroflow.config.schema import DataConfig  # noqa: E402
from zeroflow.data import BadRecord, load_chat_template, load_tokenizer  # noqa: E402
from zeroflow.data.examples import example_encoder, training_pairs  # noqa: E402
from helpers import load_script  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What does os.path.join do?"},
     {"role": "assistant", "content": "Join two or more pathname components."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "hi  there\n"},
     {"role": "assistant", "content": " Hello!  "},
     {"role": "user", "content": "é 中文 🙂"},
     {"role": "assistant", "content": "def f(x):\n    return x\n"}],
]

# A second template in the style of published ones: whitespace control, loop.last, namespace,
# tojson, raise_exception, and generation markers around the assistant text only.
CONFIG_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}"
    "{%- endif -%}{%- endfor -%}"
    "{{- bos_token -}}{%- if ns.system %}[SYS] {{ ns.system | tojson }}\n{% endif -%}"
    "{%- for m in messages if m.role != 'system' -%}"
    "{%- if m.role == 'user' -%}[INST] {{ m.content | trim }} [/INST]"
    "{%- elif m.role == 'assistant' -%} {% generation -%}{{ m.content }}{{ eos_token }}"
    "{%- endgeneration %}{% if not loop.last %}\n{% endif -%}"
    "{%- else -%}{{ raise_exception('unknown role ' + m.role) }}{%- endif -%}"
    "{%- endfor -%}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The tiny Llama's tokenizer, chat template included (no model weights needed here)."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    load_script("make_tiny_hf").train_tokenizer(folder, vocab_size=300, max_bytes=100_000)
    return folder


@pytest.fixture(scope="module")
def config_template_dir(tokenizer_dir, tmp_path_factory):
    """The same tokenizer with CONFIG_TEMPLATE in tokenizer_config.json instead of a file."""
    folder = tmp_path_factory.mktemp("config-template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CONFIG_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _encoder(folder, **fields):
    cfg = DataConfig(tokenizer=str(folder), **{"format": "chat", **fields})
    return example_encoder(cfg, load_tokenizer(folder), seq_len=512)


@pytest.mark.parametrize("which", ["jinja_file", "tokenizer_config"])
def test_chat_ids_and_assistant_mask_equal_transformers(which, tokenizer_dir, config_template_dir):
    folder = tokenizer_dir if which == "jinja_file" else config_template_dir
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    encode = _encoder(folder)
    for conversation in CONVERSATIONS:
        want = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        got = encode({"messages": conversation})
        assert got.tokens.tolist() == list(want["input_ids"])
        assert got.trained.astype(int).tolist() == list(want["assistant_masks"])
        assert 0 < got.trained.sum() < len(got.tokens)
        # The loss trains on predicting exactly the assistant tokens.
        pairs = training_pairs(got)
        assert np.array_equal(pairs["weights"], np.asarray(want["assistant_masks"][1:]))
        assert np.array_equal(pairs["targets"], np.asarray(want["input_ids"][1:]))
    # The generation prompt (used by zeroflow.sample --chat) renders the same text too.
    template = load_chat_template(folder)
    text, _ = template.render(CONVERSATIONS[0][:1], add_generation_prompt=True)
    assert text == reference.apply_chat_template(CONVERSATIONS[0][:1], tokenize=False,
                                                 add_generation_prompt=True)


def test_train_on_all_and_template_errors(tokenizer_dir, config_template_dir):
    every = _encoder(tokenizer_dir, train_on="all")({"messages": CONVERSATIONS[1]})
    assert every.trained.all()
    with pytest.raises(BadRecord, match="rejected by the chat template.*roles must be"):
        _encoder(tokenizer_dir)({"messages": [{"role": "tool", "content": "x"}]})
    # A template without {% generation %} cannot say what to train on.
    folder = config_template_dir.parent / "no-markers"
    shutil.copytree(config_template_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs a chat template that marks"):
        _encoder(folder)
    assert _encoder(folder, train_on="all")({"messages": CONVERSATIONS[0]}).trained.all()


def test_prompt_completion_and_text_match_the_tokenizer(tokenizer_dir):
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    cfg = DataConfig(format="prompt_completion", tokenizer=str(tokenizer_dir))
    record = {"prompt": "Q: what is 2+2?\nA:", "completion": " 4, é"}
    got = example_encoder(cfg, tokenizer, 64)(record)
    prompt = reference(record["prompt"])["input_ids"]  # with its begin-of-text token
    completion = reference(record["completion"], add_special_tokens=False)["input_ids"]
    assert got.tokens.tolist() == prompt + completion + [reference.eos_token_id]
    assert got.trained.tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)

    text = example_encoder(DataConfig(format="text", tokenizer=str(tokenizer_dir)), tokenizer, 64)(
        {"text": "def f(): pass"})
    assert text.tokens.tolist() == reference("def f(): pass")["input_ids"] + [reference.eos_token_id]
    assert text.trained.all()

"""ModelOptions that reach transformers' `from_pretrained` (a hub revision, any other keyword:
`init_kwargs`) and the tokenizer (a chat template override), checked before any weights load."""

import json
import shutil

import huggingface_hub.constants
import pytest
from transformers import AutoTokenizer

from grpo_lightning.io.export import export_policy
from grpo_lightning.io.models import ModelOptions, load_model, model_positions, policy_parts
from grpo_lightning.training.module import GRPOModule
from tests.helpers import cli_error, digit_reward, one_error_line
from tests.test_interrupt import fit_args


@pytest.fixture
def hub_cache(tiny_model_dir, tmp_path, monkeypatch) -> str:
    """An offline Hub cache holding the repo "org/tiny" at two revisions: "main", the tiny model as it is,
    and the tag "v1", whose config has no KV cache and 77 positions and whose tokenizer says 77 tokens."""
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for ref, commit in (("main", "a" * 40), ("v1", "b" * 40)):
        shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)
    v1 = repo / "snapshots" / ("b" * 40)
    for name, changes in (
        ("config.json", {"use_cache": False, "max_position_embeddings": 77}),
        ("tokenizer_config.json", {"model_max_length": 77}),
    ):
        path = v1 / name
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return "org/tiny"


def test_a_revision_loads_the_policy_its_config_and_its_tokenizer_at_that_revision(hub_cache):
    options = ModelOptions(revision="v1")
    source, _, tokenizer = policy_parts(hub_cache, None, options)
    assert tokenizer.model_max_length == 77
    assert model_positions(None, source, options) == 77
    assert load_model(source, options).config.use_cache is False
    # Without it, the default branch.
    _, _, tokenizer = policy_parts(hub_cache, None, ModelOptions())
    assert tokenizer.model_max_length != 77
    assert load_model(hub_cache, ModelOptions()).config.use_cache is True
    assert model_positions(None, hub_cache, ModelOptions()) != 77


def test_no_revision_loads_a_local_folder_and_a_revision_for_one_is_refused(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    assert load_model(tiny_model_dir, ModelOptions(revision=None)).config.vocab_size == 400
    with pytest.raises(ValueError, match="is a local folder, which has no revisions"):
        load_model(tiny_model_dir, ModelOptions(revision="v1"))
    err = cli_error(fit_args(tiny_model_dir, str(tmp_path), 1, "--model.model_options.revision=v1"), capsys)
    assert one_error_line(err).startswith(
        f"error: ModelOptions.revision='v1': the policy {tiny_model_dir!r} is a local folder, which has no "
        "revisions: drop the revision"
    )


@pytest.mark.parametrize(
    ("keyword", "option"),
    [
        ("attn_implementation", "attn_implementation"),
        ("torch_dtype", "dtype"),
        ("revision", "revision"),
        ("quantization_config", "load_in_4bit"),
    ],
)
def test_an_init_kwarg_that_an_option_sets_is_refused_naming_the_option(keyword, option):
    with pytest.raises(ValueError) as error:
        ModelOptions(init_kwargs={"low_cpu_mem_usage": True, keyword: "eager"})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("ModelOptions.init_kwargs=")
    assert message.endswith(f"must not hold {keyword!r}, an option here: set ModelOptions.{option}")


def test_init_kwargs_reach_from_pretrained(tiny_model_dir):
    plain = load_model(tiny_model_dir, ModelOptions())
    assert plain.config.use_cache is True and plain.config.output_hidden_states is False
    model = load_model(
        tiny_model_dir, ModelOptions(init_kwargs={"use_cache": False, "output_hidden_states": True})
    )
    assert model.config.use_cache is False and model.config.output_hidden_states is True


def test_init_kwargs_must_be_a_mapping():
    with pytest.raises(
        ValueError, match=r"ModelOptions.init_kwargs=\['use_cache'\]: must be a mapping of names to values or"
    ):
        ModelOptions(init_kwargs=["use_cache"])


# A template of our own: a plain question-and-answer layout, unlike the tiny tokenizer's ChatML.
QA_TEMPLATE = (
    "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
CHAT = [{"role": "user", "content": "What is 2 plus 3?"}]


@pytest.mark.parametrize("given_as", ["text", "file"])
def test_a_chat_template_override_encodes_the_prompts_and_goes_with_the_export(
    tiny_model_dir, tmp_path, given_as, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    if given_as == "file":
        (tmp_path / "qa.jinja").write_text(QA_TEMPLATE)
    options = ModelOptions(chat_template=QA_TEMPLATE if given_as == "text" else "qa.jinja")
    module = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward], model_options=options)
    ids, _ = module.rollouts.encoder.encode([CHAT], "cpu")  # [1, P]
    expected = module.tokenizer("Q: What is 2 plus 3?\nA:", add_special_tokens=False)["input_ids"]
    assert ids[0].tolist() == expected
    own = GRPOModule(tiny_model_dir, reward_funcs=[digit_reward])  # the tokenizer's ChatML
    assert own.rollouts.encoder.encode([CHAT], "cpu")[0][0].tolist() != expected
    out = export_policy(module, str(tmp_path / "export"))
    assert AutoTokenizer.from_pretrained(out).chat_template == QA_TEMPLATE


def test_a_missing_chat_template_file_or_one_that_does_not_compile_is_one_line_before_weights_load(
    tiny_model_dir, tmp_path, capsys, no_weights
):
    missing = str(tmp_path / "nowhere.jinja")
    err = cli_error(
        fit_args(tiny_model_dir, str(tmp_path), 1, f"--model.model_options.chat_template={missing}"), capsys
    )
    assert one_error_line(err) == (
        f"error: ModelOptions.chat_template={missing!r}: no such file: give a Jinja template, or the path of "
        "a file holding one (.jinja)"
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    err = cli_error(
        fit_args(tiny_model_dir, str(tmp_path), 1, f"--model.model_options.chat_template={broken}"), capsys
    )
    assert one_error_line(err).startswith(
        f"error: ModelOptions.chat_template={str(broken)!r} does not compile at line 2: "
    )
    with pytest.raises(
        ValueError, match=r"^ModelOptions.chat_template \(a template of 11 characters\) does "
    ):
        GRPOModule(
            tiny_model_dir,
            reward_funcs=[digit_reward],
            model_options=ModelOptions(chat_template="{% if %}x{{"),
        )

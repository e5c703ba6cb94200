"""`TieredLLM(..., backend=...)` picks its class by name: the vLLM front end is a TieredLLM subclass,
made without `tierkv.llm` importing the vLLM integration."""
import pytest

from tierkv.llm import BACKENDS, TieredLLM, backend_class


def test_every_backend_names_a_tieredllm_subclass():
    for backend in BACKENDS:
        cls = backend_class(backend)
        assert issubclass(cls, TieredLLM)
    assert backend_class("transformers") is TieredLLM
    assert backend_class("vllm").__name__ == "VllmTieredLLM"


@pytest.mark.parametrize("args, kwargs", [(("/no/such/model", None, "vllm"), {}),
                                          (("/no/such/model",), {"backend": "vllm"})])
def test_backend_vllm_runs_the_vllm_front_ends_checks(args, kwargs):
    """Positional or keyword, backend="vllm" reaches VllmTieredLLM.__init__ (its own message), not
    the transformers loader."""
    with pytest.raises(ValueError, match="backend='vllm' needs a local checkpoint directory"):
        TieredLLM(*args, **kwargs)


def test_an_unknown_backend_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"backend: got 'sglang'; allowed: transformers, vllm"):
        TieredLLM("/no/such/model", None, backend="sglang")


def test_the_vllm_front_end_refuses_another_backend_name():
    with pytest.raises(ValueError, match="VllmTieredLLM is backend='vllm'"):
        backend_class("vllm")("/no/such/model", None, "transformers")


def test_the_vllm_front_end_refuses_run_time_config_changes_by_name():
    llm = object.__new__(backend_class("vllm"))
    with pytest.raises(NotImplementedError, match="backend='vllm'"):
        llm.reload_config({})


@pytest.mark.parametrize("backend", [["vllm"], {"vllm": 1}, None, 3])
def test_a_backend_that_is_not_a_name_is_refused_by_name(backend):
    with pytest.raises(ValueError, match=r"backend: got .*; allowed: transformers"):
        backend_class(backend)

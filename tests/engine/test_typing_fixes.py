"""Outputs as their types promise: a beam search that fails still ends in a ``BeamSearchOutput``.

``LLM.beam_search`` returns ``list[BeamSearchOutput]``; a search ended by an error (a grammar or
sampling failure) came back as a plain ``RequestOutput``, without the ``sequences`` vLLM code reads.
"""

from __future__ import annotations

from raypaged.core.outputs import RequestFailure
from raypaged.engine.core import BeamResult, EngineCoreOutputs
from raypaged.engine.output_processor import OutputProcessor
from raypaged.outputs import BeamSearchOutput
from raypaged.sampling_params import SamplingParams


def test_a_failed_beam_search_ends_in_a_beam_search_output_with_its_error():
    processor = OutputProcessor(tokenizer=None)  # no text to decode: the search has no beams
    processor.add_beam_search("req", "a prompt", [1, 2, 3], SamplingParams(temperature=0, logprobs=4), "core-1")
    outputs, stopped, to_abort = processor.process(
        EngineCoreOutputs(beams=[BeamResult("core-1", [], error=RequestFailure("advancing the grammar failed: boom"))]),
        0.0,
    )
    assert (stopped, to_abort) == ([], [])
    [output] = outputs
    assert isinstance(output, BeamSearchOutput)
    assert (output.request_id, output.prompt, output.prompt_token_ids) == ("req", "a prompt", [1, 2, 3])
    assert output.finished and output.error == "advancing the grammar failed: boom"
    assert output.outputs == [] and output.sequences == []
    assert "req" not in processor

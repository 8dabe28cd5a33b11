"""Values and pure transitions: no I/O, no CUDA, no KV allocation."""

from engine.state.batch import MAX_TREE_NODES, PADDING_SLOT, Batch, DraftTrees, Mode
from engine.state.effects import Effects, Result
from engine.state.finish import FinishReason, first_finish
from engine.state.params import SamplingParams
from engine.state.running import FinishRules, Running
from engine.state.seqlens import SeqLens, frozen_array
from engine.state.structured import StructuredOutputs
from engine.state.transitions import (
    abandon,
    abort,
    admit,
    assume_decoded,
    decode,
    decode_writes,
    extend,
    finish,
    kept_rows,
    merge,
    narrow,
    retract,
    same_layout,
    schedule_decode,
    schedule_extend,
    schedule_verify,
    share,
    verify,
    writes_whole,
)

__all__ = [
    "MAX_TREE_NODES",
    "PADDING_SLOT",
    "Batch",
    "DraftTrees",
    "Mode",
    "FinishReason",
    "first_finish",
    "SamplingParams",
    "FinishRules",
    "Running",
    "SeqLens",
    "StructuredOutputs",
    "frozen_array",
    "Effects",
    "Result",
    "abandon",
    "abort",
    "admit",
    "assume_decoded",
    "decode",
    "decode_writes",
    "extend",
    "finish",
    "kept_rows",
    "merge",
    "narrow",
    "retract",
    "same_layout",
    "share",
    "schedule_decode",
    "schedule_extend",
    "schedule_verify",
    "verify",
    "writes_whole",
]

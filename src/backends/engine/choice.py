"""One engine request's outputs turned into deltas: detokenizing, stop strings, the output parser, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from backends.engine.detokenizer import IncrementalDetokenizer, TokenTable
from backends.engine.prompts import OutputParser
from backends.engine.protocol import EngineOutput, FinishReason
from backends.engine.stop import StopMatcher
from backends.errors import ContextLengthExceededError, InvalidRequestError, OverloadedError, UpstreamError
from backends.interface import Delta, TokenLogprob, ToolCallDelta, TopLogprob

_token_id = attrgetter("token_id")


class Choice:
    """Turns one engine request's outputs into deltas: detokenize, match stops, parse, format logprobs."""

    __slots__ = (
        "_detok",
        "_logprobs",
        "_parser",
        "_parser_stops",
        "_reasoning_end",
        "_reasoning_open",
        "_reasoning_unstarted",
        "_reported",
        "_stop",
        "_table",
        "end_logprobs",
        "index",
        "reasoning_tokens",
        "tokens",
    )

    def __init__(
        self,
        index: int,
        table: TokenTable,
        detok: IncrementalDetokenizer,
        stops: list[str],
        logprobs: bool,
        parser: OutputParser | None = None,
        reasoning_end: int | None = None,
    ) -> None:
        self.index = index
        self._table = table
        self._detok = detok
        self._stop = StopMatcher(stops) if stops and parser is None else None  # else the parser matches them
        self._logprobs = logprobs
        self._parser = parser
        self._parser_stops = bool(stops) and parser is not None  # the parser was given them: it may match one
        self._reasoning_end = reasoning_end
        self._reasoning_open = parser is not None and parser.in_reasoning  # tokens count as reasoning until </think>
        self._reasoning_unstarted = parser is not None and parser.drops_leading_newlines  # newlines first: not counted
        self.tokens = 0
        self._reported = 0  # tokens the deltas so far accounted for
        self.reasoning_tokens = 0
        self.end_logprobs: list[TokenLogprob] | None = None  # the EOS that ended the choice, counted as output

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        if self._parser is not None:
            return self._parser.matched_stop
        return self._stop.matched if self._stop is not None else None

    def consume(self, outputs: Sequence[EngineOutput]) -> tuple[Delta | None, str | None]:
        """Returns the delta to emit (if any) and the OpenAI finish reason once the choice is done."""
        last = outputs[-1]
        finish: str | None = None
        real: Sequence[EngineOutput]
        if last.finished:
            finish = finish_reason(last)
            # A "stop" finish carries the EOS token, which is not output; under ignore_eos an EOS sampled on the
            # way to max_tokens ("length") is an ordinary token (empty text, but counted and given logprobs).
            real = list(outputs[:-1]) if finish == FinishReason.STOP else list(outputs)
        else:
            real = outputs
        self.tokens = last.num_output_tokens
        text = self._detok.push(list(map(_token_id, real))) if real else ""
        if finish is not None:
            text += self._detok.flush()
        matched = False
        if self._stop is not None:
            text, matched = self._stop.push(text)
            if matched:
                finish = "stop"
            elif finish is not None:
                text += self._stop.flush()
        if self._logprobs and finish == FinishReason.STOP and last.finished and not matched:
            self.end_logprobs = self._format_logprobs([last])
        logprobs = self._format_logprobs(real) if self._logprobs and real else None
        if self._parser is not None:
            return self._parse(text, real, logprobs, finish)
        if not text and logprobs is None:
            return None, finish
        return Delta(self.index, text, logprobs, tokens=self._report()), finish

    def _report(self) -> int:
        """The tokens generated since the previous delta, which the next delta accounts for."""
        tokens = self.tokens - self._reported
        self._reported = self.tokens
        return tokens

    def _parse(
        self, text: str, real: Sequence[EngineOutput], logprobs: list[TokenLogprob] | None, finish: str | None
    ) -> tuple[Delta | None, str | None]:
        """Split the step's text into reasoning, content and tool calls (the model family's parser)."""
        parser = self._parser
        assert parser is not None
        was_reasoning = self._reasoning_open if self._reasoning_end is not None else parser.in_reasoning
        reasoning, content, calls = parser.push(text)
        if self._parser_stops and parser.matched_stop is not None:
            finish = "stop"
        if finish is not None:
            more_reasoning, more_content, more_calls = parser.finish()
            reasoning += more_reasoning
            content += more_content
            calls = merge_call_pieces(calls, more_calls)
            if finish == "stop" and parser.called:
                finish = "tool_calls"
        if was_reasoning and real:
            self.reasoning_tokens += self._count_reasoning(real)
        if not (reasoning or content or calls) and logprobs is None:
            return None, finish
        return Delta(self.index, content, logprobs, reasoning, calls or None, self._report()), finish

    def _count_reasoning(self, outputs: Sequence[EngineOutput]) -> int:
        """Tokens of this step spent reasoning, counted as DeepSeek counts them: every token before the one that
        closes the reasoning (a tool call written inside it included), but the newlines a new reasoning starts
        with. Without a one-token ``</think>``, the tokens of the steps the parser spent reasoning."""
        end = self._reasoning_end
        if end is None:
            return len(outputs)
        bytes_of, count = self._table.bytes_of, 0
        for output in outputs:
            token = output.token_id
            if token == end:
                self._reasoning_open = False
                break
            if self._reasoning_unstarted:
                if not bytes_of[token].strip(b"\n"):
                    continue
                self._reasoning_unstarted = False
            count += 1
        return count

    def _format_logprobs(self, outputs: Sequence[EngineOutput]) -> list[TokenLogprob]:
        text_of, bytes_of = self._table.text_of, self._table.raw_bytes_of
        return [
            TokenLogprob(
                text_of[o.token_id],
                list(bytes_of[o.token_id]),
                o.token_logprob,
                [
                    TopLogprob(text_of[t], list(bytes_of[t]), lp)
                    for t, lp in zip(o.top_token_ids, o.top_logprobs, strict=False)
                ],
            )
            for o in outputs
        ]


def merge_call_pieces(first: Sequence[ToolCallDelta], second: Sequence[ToolCallDelta]) -> Sequence[ToolCallDelta]:
    """Concatenate tool-call pieces, joining a call's header and its arguments when they meet."""
    if not second:
        return first
    if not first:
        return second
    last, head = first[-1], second[0]
    if head.index == last.index and head.id is None:
        return [*first[:-1], last._replace(arguments=last.arguments + head.arguments), *second[1:]]
    return [*first, *second]


def finish_reason(output: EngineOutput) -> str:
    """Maps DeepInfer's finish reasons to OpenAI's, raising for those that are errors to the client."""
    reason = output.finish_reason
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason
    if reason == FinishReason.PROMPT_LENGTH_EXCEEDED:
        raise ContextLengthExceededError(
            f"the prompt ({output.prompt_len} tokens) does not fit the engine's context window", param="messages"
        )
    if reason == FinishReason.INSUFFICIENT_SYSTEM_RESOURCE:
        raise OverloadedError(
            "the engine stopped the request to free KV cache (insufficient_system_resource); retry later",
            retry_after=1.0,
            code="insufficient_system_resource",
        )
    if reason == FinishReason.SO_FAILED:
        if output.num_output_tokens <= 1:  # before the first token: the grammar did not compile
            raise InvalidRequestError(
                "the engine could not compile the output constraint of this request (response_format or "
                "tool_choice); check the schema, regex or grammar",
                code="invalid_output_constraint",
            )
        raise UpstreamError("the engine's output constraint failed during generation", code="output_constraint_failed")
    raise UpstreamError(f"the engine ended the request with finish_reason {reason!r}")

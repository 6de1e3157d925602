"""Which prompt chunks a scheduler iteration prefills (runtimes/batch.py step 2): turns in order of arrival,
first chunks of requests arriving together batched into one run, and chunk sizes whose K/V rows do not
depend on where a chunk begins."""

from __future__ import annotations

from speedc.runtimes.sequence import PREFILL, Sequence

ROW_TILE = 64  # rows ONNX Runtime's fused prefill computes together (chunk_size)


class PrefillTurns:
    """PREFILL_CHUNK: the most tokens one prefill run takes (a decode step waits for at most that many)."""

    def __init__(self, prefill_chunk: int) -> None:
        self.prefill_chunk = prefill_chunk
        self._turn = -1  # the id of the sequence the last prefill chunk was for

    def group(self, occupied: list[Sequence]) -> list[Sequence]:
        """The sequences prefilled in this iteration (OCCUPIED: the pool's sequences by pool row): the next
        prefilling one in order of arrival, and when it starts its prompt, the sequences in the rows after it
        that start theirs too, while the padded batch (sequences x longest first chunk) stays within
        prefill_chunk tokens: requests arriving together share each weight read of their prefill (one run).
        Only first chunks batch (BatchBackend.prefill says why)."""
        prefilling = sorted((s for s in occupied if s.state == PREFILL), key=lambda s: s.id)
        if not prefilling:
            return []
        # turns go round the prefilling sequences in order of arrival: a long prompt (or one prefilled a token a run
        # for its log-probabilities) takes one chunk in turn, never every chunk before a later request's first
        head = next((s for s in prefilling if s.id > self._turn), prefilling[0])
        self._turn = head.id
        group = [head]
        if head.prefilled == 0 and head.request.prompt_logprobs is None:
            longest = min(head.prefill_target, self.prefill_chunk)
            for sequence in occupied[head.row + 1:]:
                if sequence.state != PREFILL or sequence.prefilled or sequence.request.prompt_logprobs is not None:
                    break
                length = max(longest, min(sequence.prefill_target, self.prefill_chunk))
                if (len(group) + 1) * length > self.prefill_chunk:
                    break
                group.append(sequence)
                longest = length
        return group

    def chunk_size(self, sequence: Sequence) -> int:
        """A sequence whose prompt's log-probabilities are asked prefills a token a run: the prefill graph's
        logits are those after a chunk's last token. Otherwise no chunk is ROW_TILE * k + 1 tokens long
        (one token among them) unless the prompt is one token: ONNX Runtime's fused prefill computes the
        rows of a chunk in tiles of ROW_TILE, and a tile of one row ~1e-6 apart from a longer tile, whose
        rows do not depend on where the chunk begins (measured at 1-130 tokens). So a prompt's K/V rows
        are bitwise the same however it is chunked, and whether a prefix came from the prefix cache."""
        if sequence.request.prompt_logprobs is not None:
            return 1
        remaining = sequence.prefill_target - sequence.prefilled
        first = min(self.prefill_chunk, remaining)
        for size in range(first, max(first - ROW_TILE, 1), -1):
            rest = remaining - size
            if size % ROW_TILE != 1 and (rest == 0 or rest > self.prefill_chunk or rest % ROW_TILE != 1):
                return size
        return first

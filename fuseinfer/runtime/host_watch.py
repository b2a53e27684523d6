"""What the host does at fast decode's stop checks when a call has a streamer or stop strings.

The graphs run ``STOP_CHECK_EVERY`` (16) or more steps between two checks. At a check, :class:`HostWatch` copies
the tokens made since the last one to the host (the one sync a check costs anyway), applies transformers'
``StopStringCriteria`` to every new step of every row still running (a row that completes a stop string at step
t keeps that token and gets the pad token after it, as in transformers; rows are independent, so the steps it
ran past t change no other row), hands the corrected tokens to the streamer as one (B, k) chunk, and says whether
every row has finished (EOS or stop string). It also makes the call's result from its host copy.
"""
from __future__ import annotations

import torch


class HostWatch:
    def __init__(self, prompt: torch.Tensor, eos: torch.Tensor, pad: int, streamer=None, stop_strings=None):
        """prompt (B, P) token ids (any device); eos (n,) int64 on the CPU."""
        self.prompt = prompt.cpu()
        self.eos, self.pad = eos, pad
        self.streamer, self.criteria = streamer, stop_strings
        b = prompt.shape[0]
        self.tokens = torch.empty(b, 0, dtype=torch.long)  # (B, i) corrected new tokens so far, on the host
        self.finished_at = [None] * b  # step of each row's last token (EOS or stop string), None while running
        self.sent = 0  # tokens handed to the streamer
        self.n = None  # the result's length once every row has finished

    def _take(self, session, upto: int) -> None:
        """Bring steps [len(tokens), upto) to the host and apply the stop rules to them."""
        done = self.tokens.shape[1]
        if upto <= done or self.n is not None:
            return
        new = session.out[:session.batch, done:upto].cpu()  # (B, k)
        self.tokens = torch.cat([self.tokens, new], 1)
        stopped = []
        for t in range(done, upto):
            hits = None
            if self.criteria is not None:
                hits = self.criteria(torch.cat([self.prompt, self.tokens[:, :t + 1]], 1), None)  # (B,) bool
            for r, at in enumerate(self.finished_at):
                if at is not None:
                    continue
                eos_hit = self.eos.numel() and bool((self.tokens[r, t] == self.eos).any())
                if eos_hit or (hits is not None and bool(hits[r])):
                    self.finished_at[r] = t
                    self.tokens[r, t + 1:] = self.pad
                    if not eos_hit:
                        stopped.append(r)
            if all(at is not None for at in self.finished_at):
                self.n = t + 1
                break
        if stopped:  # the device pads these rows from now on, as for an EOS
            session.unfinished[torch.tensor(stopped, device=session.unfinished.device)] = False

    def _stream(self, upto: int) -> None:
        if self.streamer is not None and upto > self.sent:
            self.streamer.put(self.tokens[:, self.sent:upto])
            self.sent = upto

    def check(self, session, i: int) -> bool:
        """At a stop check after ``i`` tokens: True when every row has finished."""
        self._take(session, i)
        self._stream(self.n if self.n is not None else i)
        return self.n is not None

    def finish(self, session, i: int) -> torch.Tensor:
        """After the last step (``i`` tokens): the result (B, n) on the session's device; ends the stream."""
        self._take(session, i)
        n = self.n if self.n is not None else i
        self._stream(n)
        if self.streamer is not None:
            self.streamer.end()
        return self.tokens[:, :n].to(session.out.device)

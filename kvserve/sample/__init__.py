"""Sampling: from a batch of logits rows, each with its own SamplingParams, to tokens and
logprobs."""

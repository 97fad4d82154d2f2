"""Speculative decoding's worker side: proposers of draft tokens and the rejection
sampler that verifies them against the target model's distributions."""

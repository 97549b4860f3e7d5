"""The serving engine: sequences, block manager, scheduler, model runner, sampler, detokenizer."""

"""verify-logits: the FP8 forward pass against OpenAI's reference, metrics, report, plot, golden."""

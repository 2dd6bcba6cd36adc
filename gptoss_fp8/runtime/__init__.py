"""The serving runtime: one engine loop over token ids (design.md section 6).

Five small modules, one job each (nano-vllm's separation): ``sampling`` (a request's sampling
parameters and the batched sampler), ``sequence`` (a request's token ids and state), ``slots``
(the fixed budget of KV cache slots, sized at start), ``scheduler`` (who prefills which chunk and
who decodes this step, under a token budget), ``runner`` (the model, its KV cache, CUDA graphs per
batch bucket) and ``engine`` (the loop: schedule, run, postprocess; ``EngineThread`` runs it
beside an HTTP server). It imports model/ and below, knows token ids and never JSON: ``generate``
is one request through it, ``serve`` many.
"""

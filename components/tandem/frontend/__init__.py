"""The frontend: the OpenAI HTTP API, preprocessing (chat template, tokenizer), incremental
detokenization and SSE streaming, in front of a `tandem.router.pool.WorkerPool`."""

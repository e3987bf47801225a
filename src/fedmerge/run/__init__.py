"""One run: prepare (data, model, checks), set up its engine, resume, record its rounds, summarize it."""

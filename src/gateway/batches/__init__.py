"""OpenAI's Files and Batches APIs: batch work that runs on the capacity interactive traffic leaves idle."""

"""Retrieval over the user's documents: the index of synthesize's chunks (BM25, optional dense
embeddings, hybrid), its quality on the synthesized questions, and the prompt RAG builds."""

"""Tree topologies: the validated trees, the buffers they compile to, the retrieval branch's shape."""

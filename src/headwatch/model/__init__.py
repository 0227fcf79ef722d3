"""The model side: finding the head and the embedding, the weights that really train, what a forward captures."""

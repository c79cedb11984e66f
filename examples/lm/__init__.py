"""A small character-level transformer language model trained under jaxmp precision policies."""

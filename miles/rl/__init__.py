"""RL-loop building blocks that are not actors: data sources, rewards, the quickstart task,
the loop's config sections, and metric logging."""

"""The node-level TaskD proxy: TaskNet for every training job on the node, one upstream per job."""

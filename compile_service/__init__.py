"""The compile service: model config + compile config -> Inductor bundle in a content-addressed store."""

"""ZCode: an adaptive inference harness for the GLM model family."""

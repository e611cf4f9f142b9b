"""What ``apriel-serve`` adds inside vLLM's processes besides the weight receiver
(``weight_sync.receiver``): the routed-experts capture for rollout routing replay on CPU."""

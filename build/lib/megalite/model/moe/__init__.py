"""Mixture-of-experts layers: the router, the experts and how tokens travel between ranks to reach them."""

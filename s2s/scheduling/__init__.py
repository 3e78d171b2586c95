"""Who computes what each round: the scheduler and admission, the duplex lane, the K/V pages and context bound."""

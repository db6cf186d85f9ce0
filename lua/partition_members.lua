-- The reconcilers of a region that apply other regions' spends, each
-- known by its token while its heartbeat lasts.
-- KEYS[1]: a sorted set of tokens, scored by when each one's heartbeat
-- ends (ms, the store's clock).
-- ARGV[1]: "beat" (the token is alive for ARGV[3] ms from now) or "leave"
-- (it is gone); ARGV[2]: the token; ARGV[3]: the heartbeat's life (ms).
-- Drops the tokens whose heartbeat ended and replies those left.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] == 'beat' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
else
  redis.call('ZREM', KEYS[1], ARGV[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
return redis.call('ZRANGE', KEYS[1], 0, -1)

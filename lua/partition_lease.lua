-- The lease of one partition of another region's spends: the reconciler
-- that holds it is the only one of the region applying the partition.
-- KEYS[1]: the lease, holding its holder's token, with an expiry.
-- ARGV[1]: the operation: "claim" takes a free lease (and renews one held
-- by the token already), "renew" extends one the token holds, "release"
-- deletes one the token holds, "read" changes nothing.
-- ARGV[2]: the token; ARGV[3]: the lease's life (ms), from now.
-- Replies the holder after the operation ('' when free). Each operation
-- may run twice (a retried call) to the same effect.
local op, token, ttl = ARGV[1], ARGV[2], ARGV[3]
local holder = redis.call('GET', KEYS[1]) or ''
if op == 'claim' and holder == '' then
  redis.call('SET', KEYS[1], token, 'PX', ttl)
  return token
end
if holder == token and (op == 'claim' or op == 'renew') then
  redis.call('PEXPIRE', KEYS[1], ttl)
elseif holder == token and op == 'release' then
  redis.call('DEL', KEYS[1])
  return ''
end
return holder

-- Sliding window log. State: a sorted set of admitted instants (µs); only
-- admitted requests are logged, so a flood cannot grow it past the limit.
-- An entry exactly one window old no longer counts. Members are unique:
-- the instant and a number above every other member's at that instant
-- (the set's size is not: an undo or a trim leaves it below a number in
-- use, and ZADD of a member in the set adds nothing).

-- Drops the entries one window old or older; returns how many are left.
local function sliding_log_trim(key, w, now)
  local trimmed = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', fmt_int(now - w))
  if type(trimmed) == 'table' and trimmed.err then
    redis.call('DEL', key)
  end
  return redis.call('ZCARD', key)
end

-- The highest number of the members "now.k" logged at now, or 0. Only a
-- log whose newest entry is not before now can hold one.
local function sliding_log_last_at(key, now, newest)
  local k = 0
  if newest >= now then
    local score = fmt_int(now)
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, score, score)) do
      local x = tonumber(string.match(m, '^%d+%.(%d+)$'))
      if x and x > k then k = x end
    end
  end
  return k
end

local function sliding_log(key, cap, w, cost, now)
  local n = sliding_log_trim(key, w, now)
  local newest = now
  if n > 0 then
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    newest = tonumber(last[2])
  end
  if n + cost <= cap then
    return 1, cap - (n + cost), 0, math.max(newest, now) + w - now, function()
      local args = {}
      local score = fmt_int(now)
      local k = sliding_log_last_at(key, now, newest)
      for i = 1, cost do
        args[#args + 1] = score
        args[#args + 1] = string.format('%d.%d', now, k + i)
      end
      redis.call('ZADD', key, unpack(args))
      redis.call('PEXPIRE', key, fmt_int(math.ceil((math.max(newest, now) + w - now) / 1000) + EXPIRY_PAD_MS))
    end
  end
  local i = n + cost - cap - 1
  local oldest = redis.call('ZRANGE', key, i, i, 'WITHSCORES')
  return 0, math.max(cap - n, 0), math.max(tonumber(oldest[2]) + w - now, 1), newest + w - now, nil
end

-- What a check of cost would see now (usage.lua), changing nothing: the
-- entries one window old or older are counted out, not trimmed.
local function sliding_log_usage(key, cap, w, cost, now)
  local after = '(' .. fmt_int(now - w)
  local n = redis.pcall('ZCOUNT', key, after, '+inf')
  if type(n) ~= 'number' then n = 0 end
  local reset = 0
  if n > 0 then
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    reset = tonumber(last[2]) + w - now
  end
  if n + cost <= cap then
    return 1, cap - n, 0, reset
  end
  local oldest = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', fmt_int(n + cost - cap - 1), 1)
  return 0, math.max(cap - n, 0), math.max(tonumber(oldest[2]) + w - now, 1), reset
end
